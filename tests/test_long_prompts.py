"""Long prompts and batch splits: dumps of chosen rows (memory bounded, every checkpoint still compared at
those rows, local checks at their positions), llama.cpp's micro-batches (n_ubatch below the prompt's
length) put together into the prompt's tensors, error by position, --prompt-file and --rows."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import llorch_ref
from llorch_ref.dump import Dump, catalogue, select_rows, split_step, token_axis
from llorch_ref.errors import DumpError, ParameterError
from llorch_ref.harness.compare import compare_dumps
from llorch_ref.harness.run import run_subject
from llorch_ref.references.llorch import record_engine

sys.path.insert(0, str(Path(__file__).parent / "checkpoints"))
import planted_bugs as B  # noqa: E402

TEXT = ("The history of the Roman Empire spans many centuries, from the founding of the city to the fall of "
        "Constantinople in 1453, and its")


def entry_of(name):
    cp, t = name.split(".")[0][2:], name.split(".")[1]
    return catalogue()[(cp, t)]


def test_a_dump_of_chosen_rows_holds_exactly_those_rows(bpe_engine):
    ids = bpe_engine.tokenizer.encode(TEXT)
    rows = [0, 3, len(ids) // 2, len(ids) - 1]
    full = record_engine(bpe_engine, ids, prompt=TEXT, n_greedy=0)
    part = record_engine(bpe_engine, ids, prompt=TEXT, n_greedy=0, rows=rows)
    assert part.manifest()["rows"] == rows and set(part.tensors) == set(full.tensors)
    assert part.tensors["cp0.token_ids"].tolist() == ids                # the tokenization is no row tensor
    last = f".layer{bpe_engine.config.n_layers - 1}"
    after_cut = ("ffn_inp", "ffn_norm", "ffn_swiglu", "ffn_out", "l_out", "attn_post_norm", "ffn_post_norm")
    for name, a in full.tensors.items():
        want = select_rows(entry_of(name), a, rows)
        if name.endswith(last) and name.split(".")[1] in after_cut or name.startswith(("cp8", "cp11")):
            # the forward computes the last layer's FFN and the head on the kept rows only, as llama.cpp
            # computes its output rows: another BLAS call shape, the same values up to rounding
            assert np.allclose(part.tensors[name], want, rtol=1e-5, atol=1e-6), name
        else:
            assert np.array_equal(part.tensors[name], want), name
        if token_axis(entry_of(name)) is None and name.startswith("cp3"):
            assert part.tensors[name].shape[0] == len(ids)            # caches keep every position


def test_the_clean_engine_passes_at_chosen_rows(bpe_engine):
    ids = bpe_engine.tokenizer.encode(TEXT)
    rows = [1, 7, len(ids) - 1]
    sub = record_engine(bpe_engine, ids, n_greedy=0, rows=rows).to_dump()
    res = run_subject(bpe_engine, sub, "F32")
    assert res.first_divergence is None and res.positions == rows
    assert all(r.local_passed for r in res.rows if r.local is not None)
    bp = res.by_position()
    assert bp["positions"] == rows and len(bp["worst_nmse"]) == 3 and len(bp["worst_local_nmse"]) == 3


@pytest.mark.parametrize("bug,checkpoint", [(B.off_by_one_position, "1B"), (B.missing_gqa_repeat, "4"),
                                            (B.wrong_attention_scale, "4")],
                         ids=["off_by_one_position", "missing_gqa_repeat", "wrong_attention_scale"])
def test_a_planted_bug_is_named_from_chosen_rows_alone(bpe_model, bug, checkpoint, monkeypatch):
    ref, subject = llorch_ref.load(bpe_model, weights="eager"), llorch_ref.load(bpe_model, weights="eager")
    ids = ref.tokenizer.encode(TEXT)
    rows = [2, 9, len(ids) - 1]
    bug(monkeypatch, subject)
    sub = record_engine(subject, ids, n_greedy=0, rows=rows).to_dump()
    monkeypatch.undo()
    res = run_subject(ref, sub, "F32")
    fd = res.first_divergence
    assert fd is not None and fd["checkpoint"] == checkpoint and fd["by"] == "local error", fd
    bp = res.by_position()
    assert max(bp["worst_local_nmse"]) > 1e-6 and bp["positions"] == rows


def test_rows_must_be_increasing_indices(bpe_engine):
    d = record_engine(bpe_engine, bpe_engine.tokenizer.encode(TEXT), n_greedy=0, rows=[0, 1]).to_dump()
    man = {**d.manifest, "rows": [1, 0]}
    with pytest.raises(DumpError, match="rows"):
        Dump(manifest=man, tensors={}, source="x")
    with pytest.raises(ParameterError, match="rows"):
        record_engine(bpe_engine, [1, 2, 3], n_greedy=0, rows=[5])


def test_kq_entries_no_query_sees_are_not_compared(bpe_engine):
    """An engine fed token by token never computes a query's scores against later positions: zeroing them
    in the subject leaves the comparison passing; changing a seen entry does not."""
    ids = bpe_engine.tokenizer.encode(TEXT)
    ref = record_engine(bpe_engine, ids, n_greedy=0).to_dump()
    sub = record_engine(bpe_engine, ids, n_greedy=0)
    for name in [n for n in sub.tensors if n.startswith("cp4.kq.")]:
        a = sub.tensors[name]
        sub.tensors[name] = np.where(np.tril(np.ones(a.shape[1:], bool))[None], a, np.float32(0))
    assert compare_dumps(sub.to_dump(), ref, bpe_engine.config, "F32").passed("4")
    sub.tensors["cp4.kq.layer1"][0, 3, 2] += 1.0
    res = compare_dumps(sub.to_dump(), ref, bpe_engine.config, "F32")
    assert not res.passed("4") and res.first_divergence["tensor"] == "kq"


@pytest.fixture(scope="module")
def q8(tiny):
    return tiny(weight_type="Q8_0", n_layers=3, d_model=128, d_ff=192, vocab="bpe")


@pytest.mark.llamacpp
@pytest.mark.parametrize("ubatch", [1, 7])
def test_llamacpp_micro_batches_put_together(llamacpp, q8, ubatch):
    from llorch_ref.references.engines import dump_llamacpp

    eng = llorch_ref.load(q8, numerics="ggml")
    ids = eng.tokenizer.encode(TEXT)
    assert len(ids) > 2 * ubatch
    one = dump_llamacpp(q8, token_ids=ids, n_greedy=0, n_ubatch=512)
    split = dump_llamacpp(q8, token_ids=ids, n_greedy=0, n_ubatch=ubatch)
    assert split.extra["arithmetic"]["settings"]["n_ubatch"] == ubatch
    assert set(split.tensors) == set(one.tensors)
    for name in ("cp1.attn_norm.layer0", "cp2.q_proj.layer0", "cp2.v.layer0", "cp3.k_cache.layer0"):
        assert np.array_equal(split.tensors[name], one.tensors[name]), name   # no attention before them
    res = run_subject(eng, split.to_dump(), "Q8_0")
    assert res.first_divergence is None, res.first_divergence
    assert all(r.local_passed for r in res.rows if r.local is not None)


@pytest.mark.llamacpp
def test_llamacpp_micro_batches_with_chosen_rows(llamacpp, q8):
    from llorch_ref.references.engines import dump_llamacpp

    eng = llorch_ref.load(q8, numerics="ggml")
    ids = eng.tokenizer.encode(TEXT)
    rows = [0, 6, 7, 13, len(ids) - 1]                    # the edges of micro-batches of 7
    full = dump_llamacpp(q8, token_ids=ids, n_greedy=0, n_ubatch=7)
    part = dump_llamacpp(q8, token_ids=ids, n_greedy=0, n_ubatch=7, rows=rows)
    for name, a in part.tensors.items():
        base = split_step(name)[0]
        want = full.tensors[name]
        e = entry_of(base)
        if token_axis(e) is not None:                     # stored in ggml order: the canonical axes reversed
            want = select_rows(e, want.reshape(want.shape[::-1]), rows)
            a = a.reshape(a.shape[::-1])
        assert np.array_equal(a, want), name
    res = run_subject(eng, part.to_dump(), "Q8_0")
    assert res.first_divergence is None and res.positions == rows


def cli(*a):
    return subprocess.run([sys.executable, "-m", "llorch_ref.cli", *map(str, a)], capture_output=True, text=True,
                          timeout=600)


def test_rows_and_prompt_file_options(bpe_model, tmp_path):
    from llorch_ref.dump import parse_rows

    assert parse_rows("every:4", 10) == [0, 4, 8, 9] and parse_rows("last", 10) == [9]
    assert parse_rows("0,2-4", 10) == [0, 2, 3, 4] and parse_rows(None, 10) is None
    for bad in ("every:0", "3-12", "x", "4-2"):
        with pytest.raises(ParameterError):
            parse_rows(bad, 10)
    f = tmp_path / "prompt.txt"
    f.write_text(TEXT, encoding="utf-8")
    out = tmp_path / "d.safetensors"
    r = cli("dump", "--engine", "llorch", "--model", bpe_model, "--prompt-file", f, "--rows", "every:8", "--greedy", "0",
            "--out", out)
    assert r.returncode == 0, r.stderr
    d = Dump.__new__(Dump)
    from llorch_ref.dump import load_dump
    d = load_dump(out)
    n = len(d.token_ids)
    assert d.manifest["prompt"] == TEXT and d.rows == sorted(set(range(0, n, 8)) | {n - 1})
    for args, msg in [(("--prompt-file", tmp_path / "missing.txt"), "no such file"),
                      (("--prompt-file", f, "--prompt", "hi"), "not both"),
                      (("--rows", "0-999"), "outside the prompt's rows")]:
        r = cli("dump", "--engine", "llorch", "--model", bpe_model, "--greedy", "0", "--out", tmp_path / "e.safetensors",
                *args)
        assert r.returncode != 0 and msg in r.stderr and "Traceback" not in r.stderr, r.stderr
    r = cli("diff", "--subject", out, "--model", bpe_model, "--rows", "last")
    assert r.returncode != 0 and "holds its own rows" in r.stderr and "Traceback" not in r.stderr
    r = cli("diff", "--subject", out, "--model", bpe_model, "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["by_position"]["positions"] == d.rows


def test_transformers_dump_of_chosen_rows_with_decode_steps(bpe_model, bpe_engine):
    pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[hf]')")
    from llorch_ref.references.engines import dump_transformers

    ids = bpe_engine.tokenizer.encode(TEXT)
    rows = [0, 5, 11]
    full = dump_transformers(bpe_model, token_ids=ids, n_greedy=0)
    part = dump_transformers(bpe_model, token_ids=ids, n_greedy=0, rows=rows, decode_steps=2)
    kept = rows + [len(ids) - 1]
    for name, a in full.tensors.items():
        assert np.allclose(part.tensors[name], select_rows(entry_of(name), a, kept), rtol=0, atol=1e-5), name
    res = run_subject(bpe_engine, part.to_dump(), "F32")
    assert res.first_divergence is None and res.positions == kept
    assert {r.step for r in res.rows} == {0, 1, 2}


PLUGIN_SUBJECT = '''
import os
import types
import llorch_ref
from llorch_ref.references.llorch import record_engine


def make_dump(model_path, token_ids, rows=None):
    assert rows is not None and rows[-1] == len(token_ids) - 1, rows
    eng = llorch_ref.load(model_path)
    if os.environ.get("PLANT_SCALE"):       # attention scaled by a wrong factor, in this engine's own ops only
        ops = types.SimpleNamespace(**{k: getattr(eng.ops, k) for k in dir(eng.ops) if not k.startswith("__")})
        real = ops.attention
        ops.attention = lambda xp, q, k, v, mask, scale, kv_head: real(xp, q, k, v, mask, scale * 1.5, kv_head)
        eng.ops = ops
    return record_engine(eng, token_ids, n_greedy=0, rows=rows)
'''


def test_the_pytest_plugin_passes_rows_and_a_prompt_file(bpe_model, tmp_path):
    import os
    import re
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "my_engine.py").write_text(PLUGIN_SUBJECT)
    (proj / "prompt.txt").write_text(TEXT, encoding="utf-8")
    args = ["-q", "-p", "no:cacheprovider", "--llorch-subject=my_engine:make_dump", f"--llorch-model={bpe_model}", "-vv",
            "--llorch-prompt-file=prompt.txt", "--llorch-rows=every:6"]
    run = lambda **env: subprocess.run([sys.executable, "-m", "pytest", *args], cwd=proj, capture_output=True,
                                       text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(proj), **env})
    r = run()
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-1000:]
    r = run(PLANT_SCALE="1")
    assert r.returncode == 1, r.stdout[-2000:]
    assert re.search(r"llorch::cp4_attention_scores\[layer0\] +FAILED", r.stdout), r.stdout[-3000:]
    assert re.search(r"llorch::cp2_qkv\[layer0\] +PASSED", r.stdout), r.stdout[-3000:]


@pytest.mark.parametrize("ubatch", [1, 5])
def test_transformers_micro_batches_put_together(bpe_model, bpe_engine, ubatch):
    """transformers fed the prompt in micro-batches on one cache: the rows put together, the probabilities at
    their positions; the dump passes against the reference (and equals the one-batch dump before attention)."""
    pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[hf]')")
    from llorch_ref.references.engines import dump_transformers

    ids = bpe_engine.tokenizer.encode(TEXT)
    one = dump_transformers(bpe_model, token_ids=ids, n_greedy=0)
    split = dump_transformers(bpe_model, token_ids=ids, n_greedy=0, n_ubatch=ubatch, decode_steps=2)
    assert split.extra["arithmetic"]["settings"]["n_ubatch"] == ubatch
    assert np.array_equal(split.tensors["cp1.attn_norm.layer0"], one.tensors["cp1.attn_norm.layer0"])
    assert np.allclose(split.tensors["cp2.q_proj.layer0"], one.tensors["cp2.q_proj.layer0"], atol=1e-5)  # BLAS shape
    res = run_subject(bpe_engine, split.to_dump(), "F32")
    assert res.first_divergence is None, res.first_divergence
    assert res.passed("4") and {r.step for r in res.rows} == {0, 1, 2}
    assert not [w for w in res.warnings if "capture" in w], res.warnings     # the captured run = the plain one
