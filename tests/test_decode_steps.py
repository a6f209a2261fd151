"""Decode steps in dumps: the prompt's forward and N one-token steps after it, every checkpoint per step,
compared teacher-forced (both sides run the subject's tokens). Planted decode-only bugs in a subject engine
are named at their step, checkpoint and layer; llama.cpp with decode steps passes."""
from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
from llorch_test_helpers import where

import llorch_ref
from llorch_ref.dump import Dump, load_dump
from llorch_ref.errors import DumpError
from llorch_ref.harness.compare import compare_dumps
from llorch_ref.harness.run import run_subject
from llorch_ref.references.llorch import record_engine
from llorch_ref.testing.plant import DECODE_BUGS

PROMPT = "Once upon a time, there was"
STEPS = 3


def compare_planted(bpe_engine, monkeypatch, plant, config=None):
    """The subject: llorch-ref with a bug planted while it records the prompt and STEPS decode steps; the
    reference: llorch-ref, clean, fed the subject's tokens. -> the comparison (local figures included)."""
    eng = bpe_engine
    if config is not None:
        eng = llorch_ref.load(bpe_engine.path, weights="eager")
        eng.config = dataclasses.replace(eng.config, **config)
    ids = eng.tokenizer.encode(PROMPT)
    assert not config or len(ids) > config["sliding_window"]          # the prompt crosses the window
    with monkeypatch.context() as mp:
        plant(mp, len(ids))
        sub = record_engine(eng, ids, n_greedy=0, decode_steps=STEPS).to_dump()
    ref = record_engine(eng, ids, n_greedy=0, decode_ids=sub.decode_token_ids).to_dump()
    return compare_dumps(sub, ref, eng.config, "F32", local_engine=eng)


@pytest.mark.parametrize("name", list(DECODE_BUGS))
def test_a_decode_only_bug_is_named_at_its_step_checkpoint_and_layer(bpe_engine, monkeypatch, name):
    plant, config, expect = DECODE_BUGS[name]
    if config and "sliding_window" in config:
        config = {**config, "local_layers": (True,) * bpe_engine.config.n_layers}
    res = compare_planted(bpe_engine, monkeypatch, plant, config)
    fd = res.first_divergence
    assert where(fd) == expect, fd
    assert fd["by"] == "local error"
    if expect[0] > 0:            # decode-only: the prompt's forward passes everywhere
        assert all(not r.diverges for r in res.rows if r.step == 0 and r.checkpoint != "12")


def test_the_clean_engine_passes_every_step(bpe_engine, monkeypatch):
    res = compare_planted(bpe_engine, monkeypatch, lambda mp, n: None)
    assert res.first_divergence is None
    steps = {r.step for r in res.rows}
    assert steps == {0, 1, 2, 3} and all(r.local is not None for r in res.rows if r.step and r.layer is not None)


def test_steps_round_trip_through_a_file(bpe_engine, tmp_path):
    ids = bpe_engine.tokenizer.encode(PROMPT)
    rec = record_engine(bpe_engine, ids, n_greedy=0, decode_steps=2)
    d = load_dump(rec.save(tmp_path / "d.safetensors"))
    assert d.manifest["format"] == "llorch-dump/3" and sorted(d.steps) == [1, 2]
    v = d.step_view(2)
    assert v.token_ids == d.decode_token_ids[1:2] and v.past_token_ids == ids + d.decode_token_ids[:1]
    assert v.raw("3", "k_cache", 0).shape[0] == len(ids) + 2       # S = past + 1
    man = {**rec.manifest(), "decode_token_ids": []}
    with pytest.raises(DumpError, match="decode step 2"):
        Dump(manifest=man, tensors=dict(rec.tensors), source="x")


def test_steps_must_feed_the_same_tokens(bpe_engine):
    ids = bpe_engine.tokenizer.encode(PROMPT)
    a = record_engine(bpe_engine, ids, n_greedy=0, decode_steps=2).to_dump()
    b = record_engine(bpe_engine, ids, n_greedy=0, decode_ids=[1, 2]).to_dump()
    from llorch_ref.errors import HarnessError
    with pytest.raises(HarnessError, match="different decode tokens"):
        compare_dumps(a, b, bpe_engine.config, "F32")


@pytest.mark.llamacpp
@pytest.mark.parametrize("kw", [dict(), dict(flash_attn=True, kv_dtype="float16")], ids=["f32-cache", "production"])
def test_llamacpp_decode_steps_pass(llamacpp, tiny, kw):
    from llorch_ref.references.engines import dump_llamacpp

    q8 = tiny(weight_type="Q8_0", n_layers=3, d_model=128, d_ff=192, vocab="bpe")
    eng = llorch_ref.load(q8, numerics="ggml", kv_dtype=kw.get("kv_dtype", "float32"))
    sub = dump_llamacpp(q8, prompt=PROMPT, n_greedy=4, decode_steps=4, **kw).to_dump()
    res = run_subject(eng, sub, "Q8_0")
    assert res.first_divergence is None, res.first_divergence
    assert {r.step for r in res.rows} == {0, 1, 2, 3, 4}
    assert all(r.local_passed for r in res.rows if r.step and r.local is not None)


@pytest.mark.llamacpp
def test_cli_dump_with_decode_steps_then_diff(llamacpp, tiny, tmp_path):
    q8 = tiny(weight_type="Q8_0", n_layers=3, d_model=128, d_ff=192, vocab="bpe")
    run = lambda *a: subprocess.run([sys.executable, "-m", "llorch_ref.cli", *map(str, a)], capture_output=True,
                                    text=True, timeout=600)
    d = run("dump", "--engine", "llamacpp", "--model", q8, "--decode-steps", "3", "--out", tmp_path / "d.safetensors")
    assert d.returncode == 0 and "3 decode steps" in d.stdout, d.stderr
    r = run("diff", "--subject", tmp_path / "d.safetensors", "--model", q8, "--json")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr
    import json
    out = json.loads(r.stdout)
    assert {row["step"] for row in out["rows"]} == {0, 1, 2, 3} and out["first_divergence"] is None


SUBJECT = '''
import llorch_ref
from llorch_ref.model import cache as cache_mod
from llorch_ref.references.llorch import record_engine

def make_dump(model_path, token_ids, decode_steps=0):
    """llorch-ref with decode positions off by one (decode steps only)."""
    real = cache_mod.Cache.positions
    cache_mod.Cache.positions = lambda self, n: real(self, n) + (1 if n == 1 and self.pos else 0)
    try:
        return record_engine(llorch_ref.load(model_path), token_ids, n_greedy=0, decode_steps=decode_steps)
    finally:
        cache_mod.Cache.positions = real
'''


def test_the_pytest_plugin_names_a_decode_only_bug(bpe_model, tmp_path):
    import re
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "my_engine.py").write_text(SUBJECT)
    env = {"PYTHONPATH": str(proj)}
    args = ["-q", "-p", "no:cacheprovider", "--llorch-subject=my_engine:make_dump", f"--llorch-model={bpe_model}", "-vv"]
    run = lambda *a: subprocess.run([sys.executable, "-m", "pytest", *args, *a], cwd=proj, capture_output=True,
                                    text=True, timeout=600, env={**__import__("os").environ, **env})
    r = run()                                     # no decode steps: the bug is invisible
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-1000:]
    r = run("--llorch-decode-steps=2")
    assert r.returncode == 1, r.stdout[-2000:]
    assert re.search(r"llorch::cp1_rms_norm\[layer0\] +PASSED", r.stdout), r.stdout[-3000:]
    assert re.search(r"llorch::cp1B_rope\[layer0\] +FAILED", r.stdout), r.stdout[-3000:]
    assert "q@step1" in r.stdout and "first divergence: checkpoint 1B, layer 0, q@step1" in r.stdout, r.stdout[-3000:]


def test_transformers_decode_steps_pass(bpe_model):
    pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[hf]')")
    from llorch_ref.references.engines import dump_transformers

    eng = llorch_ref.load(bpe_model, weights="eager")
    sub = dump_transformers(bpe_model, prompt=PROMPT, n_greedy=4, decode_steps=3).to_dump()
    assert sorted(sub.steps) == [1, 2, 3] and len(sub.decode_token_ids) == 3
    res = run_subject(eng, sub, "F32")
    assert res.first_divergence is None, res.first_divergence
    assert {r.step for r in res.rows} == {0, 1, 2, 3}
    assert all(r.local_passed for r in res.rows if r.step and r.local is not None)


@pytest.mark.parametrize("backend", ["numpy", "numba"])
def test_a_request_reuses_the_finished_one_s_cache_and_gets_a_fresh_sequence(tiny, backend):
    """Generation keeps the cache (and decoder) a finished request leaves, reset, for the next one: the same
    object comes back, nothing of the earlier sequence shows (greedy tokens equal to a fresh engine's, after
    a longer, different request), and a request abandoned half-way leaves nothing to reuse."""
    if backend == "numba":
        pytest.importorskip("numba")
    path = tiny(vocab="bpe", weight_type="Q8_0")
    eng, fresh = llorch_ref.load(path, backend=backend), llorch_ref.load(path, backend=backend)
    want = list(fresh.generate_ids([5, 9, 2], max_tokens=6, ignore_eos=True))
    list(eng.generate_ids([7, 3, 11, 4, 8, 1, 6], max_tokens=20, ignore_eos=True))
    first = eng._spare[0][0]
    assert list(eng.generate_ids([5, 9, 2], max_tokens=6, ignore_eos=True)) == want
    assert eng._spare[0][0] is first and first.pos > 3                # reused, holding the last request
    gen = eng.generate_ids([5, 9, 2], max_tokens=6, ignore_eos=True)
    next(gen)
    gen.close()                                                       # abandoned: its pair is not put back
    assert not eng._spare
    assert list(eng.generate_ids([5, 9, 2], max_tokens=6, ignore_eos=True)) == want
