"""The llorch-dump format: writing, reading, validation, layouts; any engine as the subject of the suite."""
from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from llorch_ref.dump import Recorder, catalogue, load_dump, to_canonical
from llorch_ref.errors import DumpError

PROMPT = "Once upon a time, there was a little girl who"      # 11 tokens: T != H (9), so layouts show in shapes
HERE = Path(__file__).resolve().parent


def _relabel(src, dst, **layouts):
    from safetensors import safe_open
    from safetensors.numpy import load_file, save_file
    with safe_open(str(src), "np") as f:
        man = json.loads(f.metadata()["llorch.manifest"])
    man["layouts"].update(layouts)
    save_file(load_file(str(src)), str(dst), metadata={"llorch.manifest": json.dumps(man)})
    return dst


# -- format, no model ---------------------------------------------------------------------------------------

DIMS = {"T": 5, "S": 5, "H": 4, "KV": 2, "Hd": 8, "D": 32, "F": 48, "V": 50, "R": 8}


def _engine_side(a, entry, layouts):
    """What an engine with these layouts would store, written independently of the reader: NeoX rows
    put the even members of each rotated pair first, then the odd ones; head-major puts the head axis
    first; ggml order lists the shape innermost first over the same bytes."""
    if entry.get("rope_pairs") and layouts["rope_pairs"] == "neox":
        a = np.concatenate([a[..., 0::2], a[..., 1::2]], axis=-1)
    if entry.get("head_major") and layouts["heads"] == "head_major":
        a = a.reshape(DIMS["T"], DIMS["H"], DIMS["Hd"]) if entry["shape"] == "T,H*Hd" else a
        a = np.swapaxes(a, 0, 1)
    a = np.ascontiguousarray(a)
    return a.reshape(a.shape[::-1]) if layouts["array_order"] == "ggml" else a


@pytest.mark.parametrize("rope", ["adjacent", "neox"])
@pytest.mark.parametrize("heads", ["token_major", "head_major"])
@pytest.mark.parametrize("order", ["numpy", "ggml"])
def test_every_layout_reads_back_to_the_canonical_array(tmp_path, rope, heads, order):
    rng = np.random.default_rng(0)
    lay = {"rope_pairs": rope, "heads": heads, "array_order": order}
    rec = Recorder("t", "1", token_ids=[1, 2, 3, 4, 5], layouts=lay)
    canon = {}
    for (cp, name), e in catalogue().items():
        if e["scope"] != "layer":
            continue
        shape = [int(np.prod([DIMS[f] for f in part.split("*")])) for part in e["shape"].split(",")]
        canon[(cp, name)] = rng.standard_normal(shape).astype(np.float32)
        rec.add(f"cp{cp}.{name}", _engine_side(canon[(cp, name)], e, lay), layer=1)
    d = load_dump(rec.save(tmp_path / "d.safetensors"))
    assert d.layouts == lay
    for (cp, name), a in canon.items():
        got = d.get(cp, name, 1, DIMS)
        assert got.shape == a.shape, (cp, name)
        assert np.array_equal(got, a), (cp, name, lay)


def test_neox_reading_is_a_permutation_not_the_identity():
    e = catalogue()[("2", "q_proj")]
    a = np.arange(2 * 3 * 8, dtype=np.float32).reshape(2, 3, 8)
    got = to_canonical(a, e, {"rope_pairs": "neox", "heads": "token_major", "array_order": "numpy"}, {"R": 8})
    # neox row j<4 holds adjacent pair member 2j; row 4+j holds 2j+1
    assert got[0, 0].tolist() == [0, 4, 1, 5, 2, 6, 3, 7]


@pytest.mark.parametrize("name,layer,msg", [
    ("cp2.qq", 0, "checkpoint 2 has no tensor 'qq'"),
    ("cp99.q", 0, "no checkpoint 99"),
    ("cp2.q_proj", None, "is per layer"),
    ("cp8.logits", 3, "not per layer"),
    ("q_proj.layer0", None, "is not cp<id>"),
])
def test_unknown_or_malformed_names_are_errors(name, layer, msg):
    rec = Recorder("t", "1", token_ids=[1])
    with pytest.raises(DumpError, match=msg):
        rec.add(name, np.zeros((1, 2), np.float32), layer=layer)


def test_manifest_is_validated_against_the_schema(tmp_path):
    from safetensors.numpy import save_file
    good = Recorder("t", "1", token_ids=[1, 2]).manifest()
    for key, bad, msg in [("layouts", None, "'layouts' is a required property"),
                          ("token_ids", [], "should be non-empty"),
                          ("format", "llorch-dump/0", "is not one of"),
                          ("layouts", {"rope_pairs": "sideways", "heads": "token_major", "array_order": "numpy"},
                           "is not one of")]:
        man = dict(good)
        if bad is None:
            man.pop(key)
        else:
            man[key] = bad
        p = tmp_path / f"{key}.safetensors"
        save_file({"cp7.l_out.layer0": np.zeros((2, 4), np.float32)}, str(p),
                  metadata={"llorch.manifest": json.dumps(man)})
        with pytest.raises(DumpError, match=msg):
            load_dump(p)


def test_no_manifest_garbage_and_sidecar(tmp_path):
    from safetensors.numpy import save_file
    p = tmp_path / "bare.safetensors"
    save_file({"cp7.l_out.layer0": np.zeros((2, 4), np.float32)}, str(p))
    with pytest.raises(DumpError, match="no manifest"):
        load_dump(p)
    (tmp_path / "bare.safetensors.manifest.json").write_text(json.dumps(Recorder("t", "1", token_ids=[1, 2]).manifest()))
    assert load_dump(p).has("7", "l_out", 0)
    g = tmp_path / "garbage.safetensors"
    g.write_bytes(b"\xff" * 5)
    with pytest.raises(DumpError, match="not a safetensors file"):
        load_dump(g)
    with pytest.raises(DumpError, match="no such dump file"):
        load_dump(tmp_path / "missing.safetensors")


def test_token_tensors_must_be_integers_and_cp0_needs_a_prompt(tmp_path):
    from safetensors.numpy import save_file
    man = Recorder("t", "1", token_ids=[1, 2]).manifest()
    p = tmp_path / "f.safetensors"
    save_file({"cp12.greedy_tokens": np.zeros(3, np.float32)}, str(p), metadata={"llorch.manifest": json.dumps(man)})
    with pytest.raises(DumpError, match="must hold integers"):
        load_dump(p)
    rec = Recorder("t", "1", token_ids=[1, 2])
    rec.add("cp0.token_ids", np.array([1, 2]))
    with pytest.raises(DumpError, match="no 'prompt'"):
        rec.to_dump()


def test_torch_tensors_are_accepted():
    torch = pytest.importorskip("torch", reason="torch is not installed (pip install -e '.[hf]')")
    rec = Recorder("t", "1", token_ids=[1])
    rec.add("cp7.l_out", torch.ones(1, 4, dtype=torch.bfloat16), layer=0)
    a = rec.tensors["cp7.l_out.layer0"]
    assert a.dtype == np.float32 and a.tolist() == [[1.0] * 4]


# -- llorch-ref itself as a subject (tiny model): a change in one tensor is found where it was made -------------

def test_tiny_self_dump_and_a_planted_change_is_the_first_divergence(tiny, tmp_path):
    import llorch_ref
    from llorch_ref.harness.compare import compare_dumps
    from llorch_ref.references.llorch import record_engine

    eng = llorch_ref.load(tiny())
    ids = eng.tokenizer.encode("Once upon a time")
    d = load_dump(record_engine(eng, ids, prompt="Once upon a time", n_greedy=4).save(tmp_path / "s.safetensors"))
    ref = record_engine(eng, ids, prompt="Once upon a time", n_greedy=4)
    res = compare_dumps(d, ref, eng.config, "F32")
    assert res.first_divergence is None and not res.not_covered
    # same engine, same ids: bit-equal everywhere but cp11, whose reference side is a float64 softmax
    assert all(r.metrics.get("max_abs", 0.0) == 0.0 for r in res.rows if r.checkpoint != "11")
    t = dict(d.tensors)
    t["cp6.ffn_out.layer1"] = t["cp6.ffn_out.layer1"] * np.float32(1.01)
    d2 = type(d)(manifest=d.manifest, tensors=t, source="edited")
    res = compare_dumps(d2, ref, eng.config, "F32")
    fd = res.first_divergence
    assert (fd["checkpoint"], fd["layer"], fd["tensor"], fd["by"]) == ("6", 1, "ffn_out", "end-to-end error")
    # a checkpoint the subject leaves out is reported, never passed
    t = {k: v for k, v in d.tensors.items() if not k.startswith("cp3.")}
    res = compare_dumps(type(d)(manifest=d.manifest, tensors=t, source="partial"), ref, eng.config, "F32")
    cp3 = next(s for s in res.summary() if s["checkpoint"] == "3")
    assert cp3["passed"] is None and cp3["not_covered"] == 2 * eng.config.n_layers


def test_cli_dump_and_diff_subject_on_a_tiny_model(tiny, tmp_path):
    from llorch_ref.cli import main
    m = tiny()
    out = tmp_path / "tiny.safetensors"
    assert main(["dump", "--engine", "llorch", "--model", str(m), "--prompt", "Once upon", "--out", str(out)]) == 0
    assert main(["diff", "--subject", str(out), "--model", str(m), "--greedy", "0"]) == 0
    assert main(["prove", "--subject", str(out), "--model", str(m), "--out", str(tmp_path / "pb"),
                 "--run-id", "r1"]) == 0
    index = (tmp_path / "pb" / "r1" / "summary.md").read_text()
    assert "every checkpoint inside its band" in index and "llorch-ref" in index
    assert (tmp_path / "pb" / "r1" / "cp2_qkv" / "subject.npz").exists()
    assert main(["dump", "--engine", "llorch", "--model", str(m), "--out", str(out)]) == 2        # exists
    assert main(["dump", "--engine", "llamacpp", "--model", str(m), "--numerics", "ggml",
                 "--out", str(tmp_path / "x.safetensors")]) == 2                                       # not applied
    bad = tmp_path / "bad.safetensors"
    bad.write_text("not a dump")
    assert main(["diff", "--subject", str(bad), "--model", str(m)]) == 2


# -- the default model (F32 copy): llama.cpp, transformers and the PyTorch test engine as subjects --------------

@pytest.fixture(scope="module")
def lc_dump(llamacpp, default_f32, tmp_path_factory):
    from llorch_ref.references.engines import dump_llamacpp
    p = tmp_path_factory.mktemp("dumps") / "llamacpp.safetensors"
    return dump_llamacpp(default_f32, prompt=PROMPT, n_greedy=16).save(p)


@pytest.fixture(scope="module")
def reference(engine_f32, lc_dump):
    from llorch_ref.references.llorch import record_engine
    d = load_dump(lc_dump)
    return record_engine(engine_f32, d.token_ids, prompt=PROMPT, n_greedy=16).to_dump()


@pytest.mark.default_model
@pytest.mark.llamacpp
def test_llamacpp_dump_passes_every_checkpoint(lc_dump, engine_f32, reference):
    from llorch_ref.harness.compare import compare_dumps
    d = load_dump(lc_dump)
    assert d.layouts["array_order"] == "ggml"
    res = compare_dumps(d, reference, engine_f32.config, "F32")
    assert res.first_divergence is None, res.first_divergence
    assert not res.not_covered
    assert {s["checkpoint"] for s in res.summary()} == {s.id for s in res.specs}
    assert res.greedy["equal_prefix"] == 16


@pytest.mark.default_model
@pytest.mark.llamacpp
@pytest.mark.parametrize("layouts,where", [
    ({"rope_pairs": "neox"}, ("2", 0, "q_proj")),
    ({"heads": "head_major"}, ("2", 0, "q_proj")),
    ({"array_order": "numpy"}, ("1", 0, "attn_norm")),
])
def test_a_wrong_layout_declaration_is_named_at_the_first_checkpoint_it_affects(lc_dump, engine_f32, reference,
                                                                              tmp_path, layouts, where):
    from llorch_ref.harness.compare import compare_dumps
    d = load_dump(_relabel(lc_dump, tmp_path / "wrong.safetensors", **layouts))
    res = compare_dumps(d, reference, engine_f32.config, "F32")
    fd = res.first_divergence
    assert (fd["checkpoint"], fd["layer"], fd["tensor"]) == where
    row = next(r for r in res.rows if (r.checkpoint, r.layer, r.tensor) == where)
    key, val = next(iter(layouts.items()))
    assert "layout looks wrong" in row.metrics["error"] and f"declares {key}={val}" in row.metrics["error"]


@pytest.fixture(scope="module")
def torch_subject(default_f32):
    pytest.importorskip("torch", reason="torch is not installed (pip install -e '.[hf]')")
    sys.path.insert(0, str(HERE))
    from subjects import torch_llama

    from llorch_ref.references.engines import hf_folder_for
    return torch_llama, hf_folder_for(default_f32)


@pytest.mark.default_model
def test_torch_engine_with_other_layouts_passes(torch_subject, engine_f32):
    from llorch_ref.harness.compare import compare_dumps
    from llorch_ref.references.llorch import record_engine
    mod, folder = torch_subject
    ids = engine_f32.tokenizer.encode(PROMPT)
    sub = mod.run(folder, ids, n_greedy=8).to_dump()
    assert sub.layouts == {"rope_pairs": "neox", "heads": "head_major", "array_order": "numpy"}
    res = compare_dumps(sub, record_engine(engine_f32, ids, n_greedy=8), engine_f32.config, "F32")
    assert res.first_divergence is None, res.first_divergence
    assert [u["checkpoint"] for u in res.not_covered] == ["0"]     # it does not tokenize: reported, not passed
    assert res.greedy["equal_prefix"] == 8


@pytest.fixture(scope="module")
def f32_prompt_record(engine_f32):
    """llorch-ref's recording of PROMPT on the F32 copy without greedy tokens: the reference of every planted
    torch run (each compares against its own copy)."""
    from llorch_ref.references.llorch import record_engine
    return record_engine(engine_f32, engine_f32.tokenizer.encode(PROMPT), n_greedy=0)


@pytest.mark.default_model
@pytest.mark.parametrize("bug,where", [
    ("rms_eps", ("1", 0, "attn_norm")),
    ("rope_adjacent", ("1B", 0, "q")),
    ("pos_off_by_one", ("1B", 0, "q")),
    ("gqa_tile", ("4", 0, "kq")),
    ("scale", ("4", 0, "kq_soft_max")),
])
def test_torch_engine_planted_bugs_fail_at_their_checkpoint(torch_subject, engine_f32, f32_prompt_record, bug, where):
    from llorch_ref.harness.compare import compare_dumps
    mod, folder = torch_subject
    ids = engine_f32.tokenizer.encode(PROMPT)
    res = compare_dumps(mod.run(folder, ids, bug=bug, n_greedy=0).to_dump(), copy.deepcopy(f32_prompt_record),
                        engine_f32.config, "F32")
    fd = res.first_divergence
    assert fd is not None and (fd["checkpoint"], fd["layer"], fd["tensor"]) == where


# -- the pytest plugin, run from a separate project that only has llorch-ref installed ------------------------

def _pytest_in(project: Path, *args, env=None):
    e = {**os.environ, **(env or {})}
    e.pop("PYTEST_ADDOPTS", None)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
                           *args], cwd=project, capture_output=True, text=True, env=e, timeout=600)


@pytest.mark.default_model
@pytest.mark.llamacpp
def test_plugin_with_a_llamacpp_dump_in_a_separate_project(lc_dump, default_f32, tmp_path):
    proj = tmp_path / "proj"
    proj.mkdir()
    r = _pytest_in(proj, f"--llorch-dump={lc_dump}", f"--llorch-model={default_f32}",
                   f"--llorch-bundle-dir={tmp_path / 'bundles'}")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    n_items = 1 + 8 * 30 + 5 + 1        # cp0 + 8 layer checkpoints (1, 1B, 2..7) x 30 layers + cp8..cp12 + the verdict
    assert f"{n_items} passed" in r.stdout, r.stdout[-1500:]
    assert "first divergence: none" in r.stdout
    assert list((tmp_path / "bundles").glob("*/summary.md"))


@pytest.mark.default_model
def test_plugin_with_the_torch_engine_and_a_planted_bug(torch_subject, default_f32, tmp_path):
    """The plugin on an engine under test with a planted bug (wrong attention scale): the checkpoints before it
    pass, cp4 fails and is named. (The same engine without the bug passes every checkpoint in
    test_torch_engine_with_other_layouts_passes; a clean plugin run: test_plugin_with_a_llamacpp_dump_in_a_separate_project
    and test_plugin_with_transformers_as_the_subject.)"""
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "my_engine.py").write_text((HERE / "subjects" / "torch_llama.py").read_text())
    args = ["--llorch-subject=my_engine:make_dump", f"--llorch-model={default_f32}"]
    r = _pytest_in(proj, *args, "-vv", env={"PYTHONPATH": str(proj), "LLORCH_TORCH_BUG": "scale"})
    assert r.returncode == 1
    import re
    assert re.search(r"llorch::cp2_qkv\[layer0\] +PASSED", r.stdout), r.stdout[-3000:]
    assert re.search(r"llorch::cp4_attention_scores\[layer0\] +FAILED", r.stdout), r.stdout[-3000:]
    assert "first divergence: checkpoint 4, layer 0, kq_soft_max" in r.stdout


@pytest.mark.default_model
def test_plugin_with_transformers_as_the_subject(default_f32, tmp_path):
    pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[hf]')")
    proj = tmp_path / "proj"
    proj.mkdir()
    r = _pytest_in(proj, "--llorch-subject=llorch_ref.references.engines:transformers_subject",
                   f"--llorch-model={default_f32}", "-rs")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    # transformers does not expose raw Q.K^T: reported as not covered, never as passed
    assert "30 comparisons not covered: the subject" in r.stdout and "holds no cp4.kq" in r.stdout, r.stdout[-2000:]


def test_cli_reference_transformers_on_a_tiny_model(tiny, tmp_path, capsys):
    pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[hf]')")
    from llorch_ref.cli import main
    from llorch_ref.convert import convert_gguf_to_hf
    g = tiny(vocab="spm", tied=False, n_kv_heads=4)
    d = convert_gguf_to_hf(g, tmp_path / "hf")
    assert main(["diff", "--model", str(g), "--reference", "transformers", "--reference-model", str(d),
                 "--greedy", "4"]) == 0
    out = capsys.readouterr().out
    assert "vs transformers" in out and "first divergence: none" in out and "holds no cp4.kq" in out
    assert main(["diff", "--model", str(g), "--band-class", "F16"]) == 2       # not for a llama.cpp run
