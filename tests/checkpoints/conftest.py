"""Checkpoint runs against llama.cpp, live, on the default model: F32 copy (tight bands) and Q4_1 original."""
from __future__ import annotations

import pytest
from checkpoint_asserts import N_LAYERS


@pytest.fixture(scope="session")
def llama_f32(default_f32, llamacpp):
    from llorch_ref.references.llamacpp import LlamaCpp

    ref = LlamaCpp(default_f32, n_ctx=512, kv_dtype="float32")
    yield ref
    ref.close()


@pytest.fixture(scope="session")
def diff_f32(engine_f32, llama_f32):
    from llorch_ref.harness.run import run_diff

    assert engine_f32.config.n_layers == N_LAYERS
    return run_diff(engine_f32, n_greedy=32, context=llama_f32)      # 128: test_f32_greedy_128_equals_llamacpp (slow)


@pytest.fixture(scope="session")
def diff_q41(engine_q41, llamacpp):
    from llorch_ref.harness.run import run_diff

    return run_diff(engine_q41, n_greedy=32)


@pytest.fixture
def planted(engine_f32, llama_f32, shared_llama_dumps, monkeypatch):
    """planted(bug) -> DiffResult of the F32 run with `bug(monkeypatch, engine)` applied (undone afterwards). The
    planted bugs change llorch-ref's engine, model code and sampling, none of which the llama.cpp side runs: the runs
    with the same token ids and steps share one llama.cpp dump (shared_llama_dumps). n_greedy: 0 (no greedy
    continuation: checkpoints 0-9 are the prompt's) unless the bug's checkpoint is a greedy one (10-12)."""
    from llorch_ref.harness import run as run_mod

    def run(bug, n_greedy=0):
        bug(monkeypatch, engine_f32)
        return run_mod.run_diff(engine_f32, n_greedy=n_greedy, context=llama_f32)
    return run
