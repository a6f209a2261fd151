"""The cupy decode steps where the sequence's length picks the RoPE tables (LongRoPE's factor set, dynamic NTK's
base): a captured CUDA graph and the steps chained on the card read the tables of each step's own length, as the
eager steps and the numpy oracle do, past the original context as within it. Needs a GPU (skips without one)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from llorch_test_helpers import need_backend

import llorch_ref
from llorch_ref.backends.cupy_backend import GraphDecoder

ORIG = 16                       # the original context: the prompt ends within it, the steps cross it
PROMPT = [(7 * i + 3) % 200 + 1 for i in range(10)]
STEPS = 24


def scaled(eng, scaling):
    """eng with LongRoPE (short factors near 1, long ones up to 16) or dynamic NTK past ORIG positions."""
    half = eng.config.rope_dim // 2
    rng = np.random.default_rng(3)
    kw = {"longrope": dict(rope_freq_factors=tuple(float(f) for f in rng.uniform(1.0, 1.2, half)),
                           rope_freq_factors_long=tuple(float(f) for f in rng.uniform(1.0, 16.0, half)),
                           rope_orig_ctx=ORIG),
          "ntk": dict(rope_ntk_factor=2.0, rope_orig_ctx=ORIG)}[scaling]
    eng.config = dataclasses.replace(eng.config, **kw)
    assert eng.config.rope_by_length
    return eng


def teacher_forced(path, dtype, scaling, monkeypatch, graphs):
    """The logits [STEPS, V] of STEPS decode steps after PROMPT, fed the tokens 5, 6, ... (the same inputs
    whatever the logits), through the backend's decoder with CUDA graphs on or off."""
    import cupy as cp
    monkeypatch.setenv("LLORCH_CUDA_GRAPHS", "1" if graphs else "0")
    eng = scaled(llorch_ref.load(path, backend="cupy", dtype=dtype, n_ctx=64), scaling)
    cache = eng.new_cache()
    eng.forward(PROMPT, cache, rows=[len(PROMPT) - 1])
    dec = eng.backend.make_decoder(eng, cache)
    assert eng.backend.info["cuda_graphs"] is graphs
    rows = [cp.asnumpy(dec(5 + i)).copy() for i in range(STEPS)]
    assert cache.pos == len(PROMPT) + STEPS and (dec.graph is not None) is graphs
    return np.concatenate(rows), eng.backend.info["fused_decode"]


CASES = [("float32", "F32"), ("float16", "F32"), ("blocks", "Q8_0")]


@pytest.mark.parametrize("scaling", ["longrope", "ntk"])
@pytest.mark.parametrize("dtype,weights", CASES)
def test_cupy_graph_steps_past_the_original_context_equal_the_eager_steps(tiny, monkeypatch, dtype, weights,
                                                                          scaling):
    """Replayed graphs (the op-by-op float32 step, the fused float16 and blocks steps) against the same steps run
    eagerly, which build each step's tables from its length: equal logits on every step, those past ORIG
    included. The planted bug, the graph replayed whatever the step's tables (GraphDecoder.rope_holds always
    true: the graph keeps the tables of the length it was captured at), differs past ORIG."""
    need_backend("cupy")
    path = tiny(vocab="bpe", n_layers=2, context_length=128, weight_type=weights)
    eager, fused = teacher_forced(path, dtype, scaling, monkeypatch, graphs=False)
    assert fused is (dtype != "float32")
    graph, _ = teacher_forced(path, dtype, scaling, monkeypatch, graphs=True)
    np.testing.assert_array_equal(graph.argmax(-1), eager.argmax(-1))
    nmse = float(((graph - eager) ** 2).sum() / (eager ** 2).sum())
    assert nmse < 1e-12, nmse
    monkeypatch.setattr(GraphDecoder, "rope_holds", lambda self, pos: True)
    planted, _ = teacher_forced(path, dtype, scaling, monkeypatch, graphs=True)
    within = ORIG - len(PROMPT)             # the steps that end within the original context
    np.testing.assert_allclose(planted[:within], eager[:within], rtol=1e-5, atol=1e-5)
    past = float(((planted[within:] - eager[within:]) ** 2).sum() / (eager[within:] ** 2).sum())
    assert past > 1e-6, past


@pytest.mark.parametrize("scaling", ["longrope", "ntk"])
def test_cupy_chained_greedy_tokens_past_the_original_context_are_the_oracles(tiny, monkeypatch, scaling):
    """Plain greedy generation chains the captured float32 steps on the card (GraphDecoder.chained) and stops
    chaining where a step's tables are not the graph's, captures again and chains on: the tokens are the numpy
    oracle's, 30 of them from a 10-token prompt across the original 16 positions; the host's and the device's
    positions agree at the end."""
    need_backend("cupy")
    import cupy as cp
    path = tiny(vocab="bpe", n_layers=2, context_length=128)
    ref = list(scaled(llorch_ref.load(path, backend="numpy", n_ctx=64), scaling).generate_ids(
        PROMPT, max_tokens=30, ignore_eos=True))
    eng = scaled(llorch_ref.load(path, backend="cupy", dtype="float32", n_ctx=64), scaling)
    got = list(eng.generate_ids(PROMPT, max_tokens=30, ignore_eos=True))
    assert got == ref
    cache, dec = eng._spare[0]
    assert dec.graph is not None and cache.pos == int(cp.asnumpy(cache.pos_dev)[0])
