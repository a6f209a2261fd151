"""ONNX Runtime GenAI as an engine under test: tiny random models built by onnxruntime-genai's model builder
(float32, int4 MatMulNBits), dumped through the graph with its intermediate values exposed, compared with
llorch-ref on the engine's own weights (an ONNX folder loaded as the reference's weights) and on the GGUF's;
int4's int8-activation arithmetic (numerics "ort"); planted changes in the graph named where they are."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import llorch_ref

pytest.importorskip("onnxruntime_genai", reason="the onnx extra (onnxruntime, onnxruntime-genai) is not installed")
pytest.importorskip("onnx_ir", reason="onnxruntime-genai's model builder needs onnx_ir (the onnx extra)")
pytest.importorskip("torch", reason="onnxruntime-genai's model builder needs torch (the hf extra)")

PROMPT = "Once upon a time, there was a little"


@pytest.fixture(scope="module")
def models(tiny, tmp_path_factory):
    """(the tiny GGUF, {precision: its ONNX folder}), built into a private $LLORCH_HOME."""
    from llorch_ref.references.onnx_runtime import onnx_folder_for

    old = os.environ.get("LLORCH_HOME")
    os.environ["LLORCH_HOME"] = str(tmp_path_factory.mktemp("home"))
    try:
        gguf = tiny(vocab="bpe", n_layers=2, d_model=64, n_heads=4, n_kv_heads=2)
        yield gguf, {p: onnx_folder_for(gguf, p) for p in ("fp32", "int4")}
    finally:
        if old is None:
            os.environ.pop("LLORCH_HOME", None)
        else:
            os.environ["LLORCH_HOME"] = old


def _diff(dump, model, numerics):
    from llorch_ref.checkpoints import engine_band_class
    from llorch_ref.harness.run import run_subject

    eng = llorch_ref.load(model, numerics=numerics, weights="eager")
    return run_subject(eng, dump.to_dump(), engine_band_class(eng), as_declared=False)     # this arithmetic, as asked


def test_fp32_passes_every_checkpoint_on_its_own_weights_and_the_ggufs(models):
    from llorch_ref.references.onnx_runtime import dump_onnxruntime

    gguf, f = models
    rec = dump_onnxruntime(f["fp32"], prompt=PROMPT, n_greedy=6, decode_steps=2)
    assert rec.extra["capture_invariance"]["logits_max_abs_diff"] == 0.0      # exposing values changed nothing
    assert rec.extra["arithmetic"]["numerics"] == "exact" and len(rec.extra["decode_token_ids"]) == 2
    for model in (f["fp32"], gguf):
        res = _diff(rec, model, "exact")
        assert res.first_divergence is None, res.first_divergence
        assert sum(r.local_passed is not None for r in res.rows) > 60
        assert {u["tensor"].split("@")[0] for u in res.not_covered} == {"q", "kq", "kq_soft_max"}   # fused in GQA
        assert res.greedy["equal_prefix"] == res.greedy["n"] == 6


def test_int4_weights_are_read_as_onnx_runtime_reads_them(models):
    """The loader's embedding equals what ONNX Runtime's embedding node gives (a Gather, or GatherBlockQuantized
    where the builder quantized a tied one), bit for bit; the int4 projections' integers and scales equal the
    dequantized weights."""
    from llorch_ref.loaders.onnx_folder import OnnxGraph
    from llorch_ref.references.onnx_runtime import CapturedSession

    _, f = models
    g = OnnxGraph(f["int4"])
    eng = llorch_ref.load(f["int4"], numerics="ort")
    exact = llorch_ref.load(f["int4"])
    ids = eng.tokenizer.encode(PROMPT)
    s = CapturedSession(g)
    import onnx
    s2 = CapturedSession.__new__(CapturedSession)           # the embedding value is not a layer value: expose it
    model = onnx.ModelProto()
    model.CopyFrom(g.model)
    emb = next(n.output[0] for n in model.graph.node if n.name.startswith("/model/embed_tokens/Gather"))
    model.graph.output.append(onnx.ValueInfoProto(name=emb))
    g.model = model
    s2.__init__(g, capture=False)
    out, _ = s2.run(ids, None)
    assert np.array_equal(out[emb][0], exact.weights.tok_embd[ids])
    lw, lx = eng.weights.layers[1], exact.weights.layers[1]
    assert np.array_equal(lw.w_up.dequantized(), lx.w_up) and np.array_equal(lw.wq.dequantized(), lx.wq)
    assert s.n_layers == 2


def test_int4_arithmetic_is_reproduced_by_numerics_ort(models):
    """Under numerics ort (int8 activations) the int4 engine passes every local check on its own weights; in exact
    float32 arithmetic its first projection already leaves the band: the activation quantization is arithmetic,
    and the comparison sees it."""
    from llorch_ref.references.onnx_runtime import dump_onnxruntime

    _, f = models
    rec = dump_onnxruntime(f["int4"], prompt=PROMPT, n_greedy=4, decode_steps=2)
    assert rec.extra["arithmetic"]["numerics"] == "ort"
    assert rec.extra["arithmetic"]["settings"]["accuracy_level"] == 4
    res = _diff(rec, f["int4"], "ort")
    assert res.first_divergence is None, res.first_divergence
    assert res.local_declaration == "ort/float32"
    fd = _diff(rec, f["int4"], "exact").first_divergence
    assert (fd["checkpoint"], fd["layer"], fd["by"]) == ("2", 0, "local error")


@pytest.mark.parametrize("init,change,where", [
    ("model.layers.1.mlp.up_proj.MatMul.weight_scales", lambda a: a.__imul__(np.float32(1.05)),
     ("6", 1, "ffn_swiglu")),
    ("cos_cache", lambda a: a.__setitem__(3, a[4].copy()), ("1B", 0, "k"))],
    ids=["up_proj_scales_x1.05", "rope_cache_row_3_is_row_4"])
def test_planted_change_in_the_graph_is_named(models, tmp_path, init, change, where):
    from llorch_ref.references.onnx_runtime import dump_onnxruntime
    from llorch_ref.testing.plant import plant_onnx

    _, f = models
    planted = plant_onnx(f["int4"], tmp_path / "planted", init, change)
    res = _diff(dump_onnxruntime(planted, prompt=PROMPT, n_greedy=4), f["int4"], "ort")
    fd = res.first_divergence
    assert fd is not None and (fd["checkpoint"], fd["layer"], fd["tensor"]) == where and fd["by"] == "local error"


def cli(*a, timeout=600):
    return subprocess.run([sys.executable, "-m", "llorch_ref.cli", *map(str, a)], capture_output=True, text=True,
                          timeout=timeout)


def test_cli_dump_diff_and_eval(models, tmp_path):
    gguf, f = models
    d = tmp_path / "int4.safetensors"
    r = cli("dump", "--engine", "onnxruntime", "--model", f["int4"], "--decode-steps", "1", "--greedy", "4",
            "--out", d)
    assert r.returncode == 0, r.stderr
    r = cli("diff", "--subject", d, "--model", f["int4"])
    assert r.returncode == 0 and "first divergence: none" in r.stdout, r.stdout + r.stderr
    assert "ort/float32" in r.stdout
    r = cli("diff", "--subject", d, "--model", gguf)          # the GGUF cannot run ONNX Runtime's arithmetic
    err = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.returncode == 2 and len(err) == 1 and "--numerics exact" in err[0] and "Traceback" not in r.stderr
    r = cli("diff", "--subject", d, "--model", gguf, "--numerics", "exact")      # its own weights differ: named
    assert r.returncode == 1 and "first divergence: checkpoint 2, layer 0" in r.stdout, r.stdout + r.stderr
    r = cli("dump", "--engine", "llamacpp", "--model", gguf, "--precision", "int4", "--out", tmp_path / "x")
    assert r.returncode == 2 and "--precision applies to --engine onnxruntime" in r.stderr
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    r = cli("eval", "--model", gguf, "--subject", "onnxruntime", "--precision", "int4", "--text", text, "--ctx", 32,
            "--chunks", 2)
    assert r.returncode == 0, r.stderr
    assert "Mean KLD" in r.stdout
