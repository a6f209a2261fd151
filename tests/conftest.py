"""Shared fixtures: the default model (fetched once, cached in $LLORCH_HOME), its F32 copy, tiny models."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
from llorch_test_helpers import machine_config


@pytest.fixture(scope="session")
def llamacpp():
    """Skips (with the reason) where llama-cpp-python is missing, unless LLORCH_REQUIRE_LLAMACPP=1 or the
    machine config says require_llamacpp = true."""
    if os.environ.get("LLORCH_REQUIRE_LLAMACPP") == "1" or machine_config().get("require_llamacpp"):
        import llama_cpp
        return llama_cpp
    return pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install .[llamacpp])")


@pytest.fixture(scope="session")
def default_model() -> Path:
    from llorch_ref.loaders.default_model import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def default_f32() -> Path:
    from llorch_ref.convert import default_model_copy

    return default_model_copy("float32")


@pytest.fixture(scope="session")
def engine_f32(default_f32):
    import llorch_ref

    return llorch_ref.load(default_f32)


@pytest.fixture(scope="session")
def engine_q41(default_model):
    import llorch_ref

    return llorch_ref.load(default_model)


@pytest.fixture(scope="session")
def llama_dumps():
    """{the arguments of a dump_llamacpp call: its Recorder}: llama.cpp's side of run_diff, made once a session
    (shared_llama_dumps)."""
    return {}


@pytest.fixture
def shared_llama_dumps(llama_dumps, monkeypatch):
    """run_diff's llama.cpp dumps memoized by their arguments for this test: llama.cpp's dump is a function of its
    arguments (the file, the token ids, the steps, the cache type; the subject engine is no part of them), so the
    runs with the same ones share one, each run comparing against its own copy. Dumps written to disk as they are
    recorded (store=) are not shared."""
    import copy

    from llorch_ref.harness import run as run_mod

    real = run_mod.dump_llamacpp

    def dump_once(path, context=None, store=None, **kw):
        if store is not None:
            return real(path, context=context, store=store, **kw)
        key = repr((str(path), sorted(kw.items())))
        if key not in llama_dumps:
            llama_dumps[key] = real(path, context=context, **kw)
        return copy.deepcopy(llama_dumps[key])
    monkeypatch.setattr(run_mod, "dump_llamacpp", dump_once)


@pytest.fixture(scope="session")
def blackbox_self_run():
    """The default model's reference (threads=1, its logits memoized) and its greedy run from the black-box tests'
    prompt (blackbox_helpers.self_run): (engine, prompt ids, tokens, log-probabilities)."""
    from blackbox_helpers import Memo, self_run

    import llorch_ref

    eng = Memo(llorch_ref.load(threads=1))
    return (eng, *self_run(eng))


@pytest.fixture(scope="session")
def blackbox_planted(default_model, tmp_path_factory):
    """The default model with blackbox_helpers.PLANT scaled by FACTOR (planted_copy), once a session."""
    from blackbox_helpers import planted_copy

    return planted_copy(default_model, tmp_path_factory.mktemp("bb-planted"))


@pytest.fixture(scope="session")
def llama_cpp_clean_url(default_model):
    """llama-cpp-python's server on the default model, started once a session (a skip where it is missing)."""
    from blackbox_helpers import llama_cpp_served

    yield from llama_cpp_served(default_model)


@pytest.fixture(scope="session")
def llama_cpp_planted_url(blackbox_planted):
    """llama-cpp-python's server on the planted file, started once a session (a skip where it is missing)."""
    from blackbox_helpers import llama_cpp_served

    yield from llama_cpp_served(blackbox_planted)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """tiny(**kw) -> path of a tiny random GGUF model (cached per keyword set for the session)."""
    from llorch_ref.testing.tiny import write_tiny_model

    d = tmp_path_factory.mktemp("tiny")
    made = {}

    def make(**kw):
        key = tuple(sorted(kw.items()))
        if key not in made:
            name = "_".join(f"{k}-{v}" for k, v in key) or "default"
            made[key] = write_tiny_model(d / f"{name}.gguf", **kw)
        return made[key]
    return make


@pytest.fixture(scope="module")
def bpe_model(tiny):
    """A tiny F32 model of 2 layers with a BPE vocabulary (the file is made once a session)."""
    return tiny(weight_type="F32", n_layers=2, vocab="bpe")


@pytest.fixture(scope="module")
def bpe_engine(bpe_model):
    """llorch-ref on bpe_model, weights loaded eagerly: one engine per test module (tests change its config)."""
    import llorch_ref

    return llorch_ref.load(bpe_model, weights="eager")


@pytest.fixture
def one_blas_thread(monkeypatch):
    """NumPy's BLAS on one thread, engines loaded on one: a product's rows then give one call's bits wherever the
    chunks start on BLAS's row unit (attention_chunks.row_unit); with several BLAS threads, OpenBLAS's Haswell
    kernels split a call's rows among the threads at places that follow the row count, and no chunking is bit
    for bit one call there."""
    from threadpoolctl import threadpool_limits

    monkeypatch.setenv("LLORCH_THREADS", "1")
    with threadpool_limits(limits=1, user_api="blas"):
        yield
