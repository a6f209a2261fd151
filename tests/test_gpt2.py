"""GPT-2 as an adapter: a tiny random GPT2LMHeadModel (testing.tiny_hf 'gpt2', seeded), converted to a gpt2 GGUF,
checked by `llorch-ref diff` as a user runs it against transformers (HF folder) and llama.cpp (GGUF) on every
checkpoint that applies; each GPT-2 piece dropped or changed in llorch-ref is named at its own checkpoint."""
from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys

import numpy as np
import pytest
from llorch_test_helpers import tiny_hf_gguf

import llorch_ref

PROMPT = "Once upon a time, there was a little"


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    return tiny_hf_gguf(tmp_path_factory.mktemp("gpt2"), "gpt2")


def diff_cli(*args):
    """`llorch-ref diff ... --json` in a fresh process -> (exit code, the JSON report)."""
    p = subprocess.run([sys.executable, "-m", "llorch_ref.cli", "diff", *map(str, args), "--json"],
                       capture_output=True, text=True, timeout=300)
    assert p.stdout, p.stderr[-2000:]
    return p.returncode, json.loads(p.stdout)


def test_the_model_is_gpt2(gpt2):
    folder, g, model = gpt2
    for path in (folder, g):
        c = llorch_ref.load(path).config
        assert (c.arch, c.norm, c.pos_embd, c.ffn_gated, c.linear_bias, c.qkv_bias, c.tied_output) == \
            ("gpt2", "layer", "learned", False, True, True, True)
        assert not c.uses_rope and c.context_length == model.config.n_positions


def test_diff_against_transformers_passes_every_checkpoint(gpt2):
    """The HF folder by the CLI (the GGUF path against the same transformers dump: the planted-bug tests' clean
    runs)."""
    folder, _, _ = gpt2
    rc, rep = diff_cli("--model", folder, "--reference", "transformers", "--greedy", 8)
    assert rc == 0 and rep["verdict"]["status"] == "PASS", rep["verdict"]
    assert rep["first_divergence"] is None and rep["greedy"]["equal_prefix"] == 8
    assert len(set(rep["greedy"]["ours"])) > 2               # the tiny model's greedy text is not one token
    checked = {r["checkpoint"] for r in rep["rows"]}
    assert checked == {"0", "1", "2", "3", "4", "5", "6", "7", "8", "9", "10", "11", "12"}
    assert not any(r["tensor"] in ("q", "k") for r in rep["rows"])           # no RoPE: 1B does not apply
    assert "cp1B.q" not in rep["verdict"]["required"]
    assert {u["tensor"] for u in rep["not_covered"]} == {"kq"}               # transformers exposes no raw Q.K^T
    assert max(r["nmse"] for r in rep["rows"] if r.get("nmse") is not None) < 1e-12


@pytest.mark.llamacpp
def test_diff_against_llamacpp_passes_every_covered_checkpoint(llamacpp, gpt2):
    """llama.cpp's gpt2 graph leaves the output projection unnamed (attn_out not covered: INCOMPLETE, as for
    Qwen2), and its GELU reads a float16 table: F16 bands from ffn_gelu on (a warning says so), F32 before."""
    _, g, _ = gpt2
    rc, rep = diff_cli("--model", g, "--greedy", 8)
    assert rep["first_divergence"] is None and rep["greedy"]["equal_prefix"] == 8
    assert all(r["passed"] for r in rep["rows"])
    assert rep["verdict"]["status"] == "INCOMPLETE" and rep["verdict"]["missing"] == ["cp5.attn_out"] and rc == 3
    assert len(rep["warnings"]) == 1 and "float16 table" in rep["warnings"][0]
    early = [r for r in rep["rows"] if r["layer"] == 0 and r["tensor"] in ("attn_norm", "q_proj", "k_cache", "kq",
                                                                           "kqv_out", "ffn_inp", "ffn_norm")]
    assert len(early) == 7 and all(r["nmse"] < 1e-7 for r in early)
    assert not any(r["tensor"] in ("q", "k") for r in rep["rows"])


def gelu_erf(xp, x):
    """The exact GELU, x Phi(x), where GPT-2 computes the tanh approximation."""
    erf = np.vectorize(math.erf, otypes=[np.float64])
    return (0.5 * x * (1.0 + erf(x / math.sqrt(2.0)))).astype(np.float32)


def plant(mp, eng, bug):
    """Plant one GPT-2 bug in an engine with eager weights."""
    from llorch_ref.model import layers
    w = eng.weights
    if bug == "gelu_exact" and eng.numerics == "ggml":        # its own GELU (llama.cpp's table) in its ops
        def erf_mlp(xp, x, w_up, b_up, w_down, b_down):
            h = gelu_erf(xp, layers.linear(xp, x, w_up) + b_up)
            return layers.linear(xp, h, w_down) + b_down, h
        mp.setattr(eng.ops, "gelu_mlp", erf_mlp)
    elif bug == "gelu_exact":
        mp.setattr(layers, "gelu_tanh", gelu_erf)
    elif bug == "no_positions":
        w.pos_embd = np.zeros_like(w.pos_embd)
    elif bug == "no_output_bias":                   # neither the attention output's nor the MLP's biases
        eng.config = dataclasses.replace(eng.config, linear_bias=False)
    elif bug == "no_qkv_bias":
        eng.config = dataclasses.replace(eng.config, qkv_bias=False)
    elif bug == "no_norm_bias":
        w.layers[0].attn_norm_b = np.zeros_like(w.layers[0].attn_norm_b)
    elif bug == "no_up_bias":
        w.layers[0].b_up = np.zeros_like(w.layers[0].b_up)
    elif bug == "rms_norm":                         # RMSNorm where GPT-2 has LayerNorm
        eng.config = dataclasses.replace(eng.config, norm="rms")


# bug -> where it shows (checkpoint, layer, tensor): against transformers, against llama.cpp (None: not caught)
BUGS = {
    "gelu_exact": (("6", 0, "ffn_swiglu"), None),
    "no_positions": (("1", 0, "attn_norm"), ("1", 0, "attn_norm")),
    "no_output_bias": (("5", 0, "attn_out"), ("5", 0, "ffn_inp")),          # llama.cpp: attn_out unnamed
    "no_qkv_bias": (("2", 0, "q_proj"), ("2", 0, "q_proj")),
    "no_norm_bias": (("1", 0, "attn_norm"), ("1", 0, "attn_norm")),
    "no_up_bias": (("6", 0, "ffn_swiglu"), ("6", 0, "ffn_swiglu")),
    "rms_norm": (("1", 0, "attn_norm"), ("1", 0, "attn_norm")),
}


@pytest.fixture(scope="module")
def transformers_dump(gpt2):
    from llorch_ref.references.engines import dump_transformers
    folder, g, _ = gpt2
    ids = llorch_ref.load(g).tokenizer.encode(PROMPT)
    return ids, dump_transformers(folder, token_ids=ids, n_greedy=0)


def where(fd):
    return None if fd is None else (fd["checkpoint"], fd["layer"], fd["tensor"])


@pytest.mark.parametrize("bug", BUGS)
def test_a_planted_bug_fails_against_transformers_at_its_checkpoint(gpt2, transformers_dump, bug, monkeypatch):
    from llorch_ref.harness.compare import compare_dumps
    from llorch_ref.harness.verdict import judge
    from llorch_ref.references.llorch import record_engine
    _, g, _ = gpt2
    ids, ref = transformers_dump
    eng = llorch_ref.load(g, weights="eager")
    assert compare_dumps(record_engine(eng, ids, n_greedy=0), ref, eng.config, "F32").first_divergence is None
    plant(monkeypatch, eng, bug)
    res = compare_dumps(record_engine(eng, ids, n_greedy=0), ref, eng.config, "F32")
    assert where(res.first_divergence) == BUGS[bug][0]
    assert judge(res).status == "FAIL"


@pytest.mark.llamacpp
@pytest.mark.parametrize("bug", BUGS)
def test_a_planted_bug_against_llamacpp(llamacpp, gpt2, bug, monkeypatch):
    """What `llorch-ref diff` (run_diff) says of a planted bug. The exact GELU is within llama.cpp's float16 GELU
    table's own rounding (F16 bands from ffn_gelu on): it passes there; --numerics ggml catches it (below)."""
    from llorch_ref.harness.run import run_diff
    from llorch_ref.harness.verdict import judge
    _, g, _ = gpt2
    eng = llorch_ref.load(g, weights="eager")
    plant(monkeypatch, eng, bug)
    res = run_diff(eng, prompt=PROMPT, n_greedy=0)
    assert where(res.first_divergence) == BUGS[bug][1]
    assert judge(res).status == ("INCOMPLETE" if BUGS[bug][1] is None else "FAIL")


@pytest.mark.llamacpp
def test_ggml_numerics_reproduce_llamacpp_bit_for_bit_and_catch_the_exact_gelu(llamacpp, gpt2, monkeypatch):
    """numerics='ggml' (ggml_norm's sums, GELU from the float16 table, the biases as ggml_add) gives every tensor
    and the logits bit-equal to llama.cpp's; the exact GELU planted there fails at ffn_swiglu, layer 0."""
    from llorch_ref.harness.run import run_diff
    _, g, _ = gpt2
    res = run_diff(llorch_ref.load(g, numerics="ggml"), prompt=PROMPT, n_greedy=8)
    assert res.band_class == "ggml" and res.first_divergence is None and res.greedy["equal_prefix"] == 8
    floats = [r for r in res.rows if "max_abs" in r.metrics]
    assert len(floats) > 30 and all(r.metrics["max_abs"] == 0.0 for r in floats)
    assert {r.tensor for r in floats} >= {"attn_norm", "ffn_swiglu", "result_norm", "logits"}
    eng = llorch_ref.load(g, numerics="ggml")
    plant(monkeypatch, eng, "gelu_exact")
    assert where(run_diff(eng, prompt=PROMPT, n_greedy=0).first_divergence) == ("6", 0, "ffn_swiglu")


def test_lazy_eager_and_numba_agree(gpt2):
    from llorch_ref.backends import available
    folder, g, _ = gpt2
    for path in (folder, g):
        eager = llorch_ref.load(path, weights="eager")
        ids = eager.tokenizer.encode(PROMPT)
        want = eager.logits(ids)
        np.testing.assert_array_equal(llorch_ref.load(path, weights="lazy", weight_cache_mb=0).logits(ids), want)
        if available().get("numba") is None:
            from llorch_ref.harness.run import run_backend_diff
            res = run_backend_diff(llorch_ref.load(path, backend="numba"), eager, prompt=PROMPT, n_greedy=8)
            assert res.first_divergence is None and res.greedy["equal_prefix"] == 8


def test_generation_past_the_prompt_reads_later_positions(gpt2):
    """Decode steps add the position rows of their own positions: each step's logits equal the logits of the
    whole sequence run at once."""
    _, g, _ = gpt2
    eng = llorch_ref.load(g)
    ids = eng.tokenizer.encode(PROMPT)
    cache = eng.new_cache()
    eng.forward(ids[:-3], cache)
    steps = np.concatenate([eng.forward([t], cache) for t in ids[-3:]])
    np.testing.assert_allclose(steps, eng.logits(ids)[-3:], rtol=0, atol=1e-5)


def test_gguf_to_hf_and_back(gpt2, tmp_path):
    import torch
    import transformers

    from llorch_ref.convert import convert_gguf_to_hf, convert_hf_to_gguf
    _, g, _ = gpt2
    hf = convert_gguf_to_hf(g, tmp_path / "hf")
    eng = llorch_ref.load(g)
    ids = eng.tokenizer.encode(PROMPT)
    m = transformers.AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = m(torch.tensor([ids])).logits[0].numpy()
    ours = eng.logits(ids)
    assert float(((ours - theirs) ** 2).sum() / (theirs ** 2).sum()) < 1e-12
    np.testing.assert_array_equal(llorch_ref.load(convert_hf_to_gguf(hf, tmp_path / "back.gguf")).logits(ids), ours)


def test_a_hub_layout_folder_loads_alike(gpt2, tmp_path):
    """GPT-2 files on the hub name their tensors without "transformer." (h.0.ln_1.weight, wte.weight) and carry
    the attention's mask buffers: the same model."""
    import shutil

    from safetensors.numpy import load_file, save_file
    folder, _, _ = gpt2
    hub = tmp_path / "hub"
    shutil.copytree(folder, hub)
    t = {k.removeprefix("transformer."): v for k, v in load_file(str(folder / "model.safetensors")).items()}
    t["h.0.attn.bias"] = np.tril(np.ones((1, 1, 8, 8), dtype=np.float32))
    save_file(t, str(hub / "model.safetensors"), metadata={"format": "pt"})
    ids = llorch_ref.load(folder).tokenizer.encode(PROMPT)
    np.testing.assert_array_equal(llorch_ref.load(hub).logits(ids), llorch_ref.load(folder).logits(ids))


@pytest.mark.parametrize("key, value", [("activation_function", "relu"), ("scale_attn_by_inverse_layer_idx", True),
                                        ("reorder_and_upcast_attn", True), ("add_cross_attention", True)])
def test_what_changes_the_math_is_refused_in_one_line(gpt2, tmp_path, key, value):
    import shutil
    folder, _, _ = gpt2
    odd = tmp_path / "odd"
    shutil.copytree(folder, odd)
    c = json.loads((odd / "config.json").read_text())
    c[key] = value
    (odd / "config.json").write_text(json.dumps(c))
    p = subprocess.run([sys.executable, "-m", "llorch_ref.cli", "diff", "--model", str(odd), "--reference", "numpy"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-1000:]
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and key in lines[0] and "gpt2" in lines[0]


@pytest.mark.llamacpp
def test_a_q8_0_file_passes_and_ggml_numerics_refuse_its_fused_blocks(llamacpp, gpt2, tmp_path):
    """llama.cpp's own quantizer makes a Q8_0 gpt2 file: exact numerics meet the Q8_0 bands; numerics='ggml' does
    not split quantized fused Q/K/V blocks and says so in one line (exit 2)."""
    import ctypes

    import llama_cpp

    from llorch_ref.harness.run import run_diff
    _, g, _ = gpt2
    q8 = tmp_path / "gpt2-q8_0.gguf"
    p = llama_cpp.llama_model_quantize_default_params()
    p.ftype, p.nthread = llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0, 2
    assert llama_cpp.llama_model_quantize(str(g).encode(), str(q8).encode(), ctypes.byref(p)) == 0
    res = run_diff(llorch_ref.load(q8), prompt=PROMPT, n_greedy=8)
    assert res.band_class == "Q8_0" and res.first_divergence is None and res.greedy["equal_prefix"] == 8
    r = subprocess.run([sys.executable, "-m", "llorch_ref.cli", "diff", "--model", str(q8), "--numerics", "ggml"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert [ln for ln in r.stderr.splitlines() if ln.startswith("error:")] == [
        f"error: {q8}: numerics='ggml' does not split gpt2's fused quantized projections; use numerics='exact'"]


@pytest.mark.llamacpp
def test_diff_of_a_llamacpp_dump_checks_gpt2_locally(llamacpp, gpt2, tmp_path):
    """`llorch-ref dump --engine llamacpp` then `diff --subject`: the local (teacher-forced) checks recompute each
    GPT-2 tensor from the dump's own inputs (LayerNorm, no RoPE, biased MLP), at every decode step."""
    from llorch_ref.harness.run import run_subject
    from llorch_ref.references.engines import dump_llamacpp
    _, g, _ = gpt2
    eng = llorch_ref.load(g, numerics="ggml")
    ids = eng.tokenizer.encode(PROMPT)
    res = run_subject(eng, dump_llamacpp(g, token_ids=ids, n_greedy=0, decode_steps=2, rows=[0, 5]).to_dump(), "F32")
    checked = [r for r in res.rows if r.local is not None]
    assert res.first_divergence is None and {r.step for r in res.rows} == {0, 1, 2}
    assert len(checked) > 50 and all(r.local_passed for r in checked)
    dump = tmp_path / "lc.safetensors"
    subprocess.run([sys.executable, "-m", "llorch_ref.cli", "dump", "--model", str(g), "--engine", "llamacpp",
                    "--out", str(dump)], check=True, capture_output=True, timeout=120)
    rc, rep = diff_cli("--model", g, "--subject", dump)
    assert rep["first_divergence"] is None and rep["verdict"]["missing"] == ["cp5.attn_out"]
