"""Gemma 3 as an adapter: each of its switches is needed (dropping one is caught at its own checkpoint against
transformers), the two weight conventions meet (GGUF norms hold 1 + w, HF norms w), conversion both ways, and
llama.cpp's float16 GELU table reproduced bit for bit by numerics='ggml'."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from llorch_test_helpers import tiny_hf_gguf

import llorch_ref

PROMPT = "Once upon a time, there was a little"     # 12 tokens: longer than the tiny model's window of 8


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    return tiny_hf_gguf(tmp_path_factory.mktemp("gemma3"), "gemma3")


@pytest.fixture(scope="module")
def transformers_dump(gemma):
    from llorch_ref.references.engines import dump_transformers
    folder, g, _ = gemma
    ids = llorch_ref.load(g).tokenizer.encode(PROMPT)
    assert len(ids) > 8
    return ids, dump_transformers(folder, prompt=PROMPT, token_ids=ids, n_greedy=0)


@pytest.mark.parametrize("switch, where", [
    (dict(embed_scale=None), ("1", 0, "attn_norm")),           # embeddings not scaled by sqrt(D)
    (dict(rope_base_local=None), ("1B", 0, "q")),               # local layers on the global RoPE base
    (dict(qk_norm=False), ("1B", 0, "q")),                      # no QK-norm (q_normed then not recorded)
    (dict(sliding_window=10**6), ("4", 0, "kq_soft_max")),      # no sliding window
    (dict(post_norms=False), ("5", 0, "ffn_inp")),              # no post-attention norm
    (dict(ffn_act="silu"), ("6", 0, "ffn_swiglu")),             # SwiGLU instead of GeGLU
])
def test_each_gemma3_switch_is_needed(gemma, transformers_dump, switch, where):
    from llorch_ref.harness.compare import compare_dumps
    from llorch_ref.references.llorch import record_engine
    _, g, _ = gemma
    ids, ref = transformers_dump
    eng = llorch_ref.load(g)
    assert compare_dumps(record_engine(eng, ids, n_greedy=0), ref, eng.config, "F32").first_divergence is None
    eng.config = dataclasses.replace(eng.config, **switch)
    fd = compare_dumps(record_engine(eng, ids, n_greedy=0), ref, eng.config, "F32").first_divergence
    assert fd is not None and (fd["checkpoint"], fd["layer"], fd["tensor"]) == where


def test_norm_conventions_meet(gemma):
    """The HF folder stores w (applied as 1 + w); the GGUF stores 1 + w: both load as the same multipliers."""
    folder, g, model = gemma
    a, b = llorch_ref.load(folder), llorch_ref.load(g)
    la, lb = a.weights.layers[0], b.weights.layers[0]
    for f in ("attn_norm", "ffn_norm", "post_attn_norm", "post_ffn_norm", "q_norm", "k_norm"):
        np.testing.assert_array_equal(getattr(la, f), getattr(lb, f))
    hf_w = model.model.layers[0].input_layernorm.weight.detach().numpy()
    np.testing.assert_array_equal(la.attn_norm, hf_w + np.float32(1))
    ids = a.tokenizer.encode(PROMPT)
    np.testing.assert_array_equal(a.logits(ids), b.logits(ids))


def test_gguf_to_hf_and_back(gemma, tmp_path):
    """GGUF -> HF folder (norms shifted back to w) loads in transformers with our logits; -> GGUF again is the
    same model."""
    import torch
    import transformers

    from llorch_ref.convert import convert_gguf_to_hf, convert_hf_to_gguf
    _, g, _ = gemma
    hf = convert_gguf_to_hf(g, tmp_path / "hf")
    eng = llorch_ref.load(g)
    ids = eng.tokenizer.encode(PROMPT)
    m = transformers.AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32,
                                                          attn_implementation="eager").eval()
    with torch.no_grad():
        theirs = m(torch.tensor([ids])).logits[0].numpy()
    ours = eng.logits(ids)
    assert float(((ours - theirs) ** 2).mean() / (theirs ** 2).mean()) < 1e-10
    back = convert_hf_to_gguf(hf, tmp_path / "back.gguf")
    np.testing.assert_array_equal(llorch_ref.load(back).logits(ids), ours)


def test_conversion_refuses_what_gguf_cannot_say(gemma, tmp_path):
    import json
    import shutil

    from llorch_ref.convert import convert_hf_to_gguf
    from llorch_ref.errors import ParameterError
    folder, _, _ = gemma
    odd = tmp_path / "odd"
    shutil.copytree(folder, odd)
    c = json.loads((odd / "config.json").read_text())
    c["query_pre_attn_scalar"] = 256                 # transformers' default, not head_dim: llama.cpp cannot say it
    (odd / "config.json").write_text(json.dumps(c))
    with pytest.raises(ParameterError, match="attention scale"):
        convert_hf_to_gguf(odd, tmp_path / "odd.gguf")
    assert not (tmp_path / "odd.gguf").exists()


def test_multimodal_gemma3_folder_is_refused(tmp_path):
    from llorch_ref.errors import UnsupportedModelError
    from llorch_ref.loaders.hf_folder import config_from_hf
    with pytest.raises(UnsupportedModelError, match="gemma3_text"):
        config_from_hf({"model_type": "gemma3"}, tmp_path)


@pytest.mark.llamacpp
def test_ggml_numerics_reproduce_llamacpp_gemma3_layers_bit_for_bit(llamacpp, gemma):
    """numerics='ggml' (llama.cpp's CPU arithmetic, incl. GELU from its float16 table) gives every layer tensor
    bit-equal to llama.cpp's; the exact reference differs from the GEGLU on (float16 rounding)."""
    from llorch_ref.harness.run import run_diff
    _, g, _ = gemma
    res = run_diff(llorch_ref.load(g, numerics="ggml"), prompt=PROMPT, n_greedy=8)
    layer_rows = [r for r in res.rows if r.layer is not None]
    assert len(layer_rows) > 100 and all(r.metrics["max_abs"] == 0.0 for r in layer_rows)
    assert res.greedy["equal_prefix"] == 8
    exact = run_diff(llorch_ref.load(g), prompt=PROMPT, n_greedy=0, checkpoints=["6"])
    swiglu0 = next(r for r in exact.rows if r.layer == 0 and r.tensor == "ffn_swiglu")
    assert 0 < swiglu0.metrics["nmse"] < 1e-5


def test_gelu_table_matches_the_formula_to_float16():
    from llorch_ref.model.layers import gelu_tanh
    from llorch_ref.numerics.ggml_cpu import geglu_act
    x = np.linspace(-12, 12, 20001, dtype=np.float32)
    exact, table = gelu_tanh(np, x), geglu_act(x, np.ones_like(x))
    assert np.abs(table - exact).max() <= 2e-3 * np.abs(exact).max()
    assert table[x <= -10].max() == 0 and np.array_equal(table[x >= 10], x[x >= 10])


@pytest.mark.parametrize("backend", ["numba", "cupy"])
def test_backends_run_gemma3_like_numpy(gemma, backend):
    """QK-norm (3-D rows), GeGLU and the per-layer windows and RoPE tables on the numba / cupy backends."""
    from llorch_ref.backends import available
    from llorch_ref.harness.run import run_backend_diff
    why = available().get(backend)
    if why:
        pytest.skip(f"backend {backend} unavailable: {why}")
    _, g, _ = gemma
    res = run_backend_diff(llorch_ref.load(g, backend=backend), llorch_ref.load(g, backend="numpy"), prompt=PROMPT,
                           n_greedy=16)
    assert res.first_divergence is None, res.first_divergence
    assert res.greedy["equal_prefix"] == 16


@pytest.mark.llamacpp
def test_a_llamacpp_dump_of_gemma3_meets_the_same_bands(llamacpp, gemma, tmp_path):
    """The dump path (llama.cpp as a dump writer, compared as a subject) applies the spec's reduced-precision
    node the way `diff` does, and carries Gemma 3's QK-norm tensors in their canonical layout."""
    from llorch_ref.harness.compare import compare_dumps
    from llorch_ref.references.engines import dump_llamacpp
    from llorch_ref.references.llorch import record_engine
    _, g, _ = gemma
    eng = llorch_ref.load(g)
    ids = eng.tokenizer.encode(PROMPT)
    lc = dump_llamacpp(g, prompt=PROMPT, token_ids=ids, n_greedy=8)
    res = compare_dumps(lc, record_engine(eng, ids, prompt=PROMPT, n_greedy=8), eng.config, "F32")
    assert res.first_divergence is None, res.first_divergence
    assert res.warnings and "float16 table" in res.warnings[0]
    assert any(r.tensor == "q_normed" and r.passed for r in res.rows)


def test_local_checks_of_neox_rows_pass_across_the_window(gemma):
    """Gemma's Q/K rows are in NeoX order as loaded: the local checks feed the engine's ops the subject's
    canonical arrays in that order and bring the outputs back (a mix-up gives NMSE ~2 at q_proj). A clean
    subject, chosen rows and decode steps that cross the tiny model's window of 8, passes every local check."""
    from llorch_ref.harness.run import run_subject
    from llorch_ref.references.llorch import record_engine
    _, g, _ = gemma
    eng = llorch_ref.load(g)
    assert eng.qk_rows == "neox"
    ids = eng.tokenizer.encode(PROMPT)
    sub = record_engine(eng, ids, n_greedy=0, decode_steps=3, rows=[0, 5, 9]).to_dump()
    res = run_subject(eng, sub, "F32")
    checked = [r for r in res.rows if r.local is not None]
    assert {"q_proj", "q_normed", "q", "k", "k_cache"} <= {r.tensor.split("@")[0] for r in checked}
    assert all(r.local_passed for r in checked), [(r.tensor, r.layer, r.local["nmse"]) for r in checked
                                                  if not r.local_passed][:5]
    assert res.first_divergence is None


@pytest.mark.llamacpp
def test_llamacpp_on_gemma_passes_across_the_window_at_every_step(llamacpp, gemma):
    from llorch_ref.harness.run import run_subject
    from llorch_ref.references.engines import dump_llamacpp
    _, g, _ = gemma
    eng = llorch_ref.load(g, numerics="ggml")
    ids = eng.tokenizer.encode(PROMPT)
    sub = dump_llamacpp(g, token_ids=ids, n_greedy=0, decode_steps=3, rows=[0, 9]).to_dump()
    res = run_subject(eng, sub, "F32")
    assert res.first_divergence is None, res.first_divergence
    assert {r.step for r in res.rows} == {0, 1, 2, 3}
    assert all(r.local_passed for r in res.rows if r.local is not None)


def test_transformers_decode_steps_past_the_window_pass(gemma):
    """transformers keeps a sliding-window layer's cache to its window: a decode step's probabilities cover
    the window's positions only, and the writer places them at those positions of the whole cache."""
    from llorch_ref.harness.run import run_subject
    from llorch_ref.references.engines import dump_transformers
    folder, g, _ = gemma
    eng = llorch_ref.load(g)
    ids = eng.tokenizer.encode(PROMPT)
    sub = dump_transformers(folder, prompt=PROMPT, token_ids=ids, n_greedy=0, decode_steps=3).to_dump()
    res = run_subject(eng, sub, "F32")
    probs = [r for r in res.rows if r.tensor.startswith("kq_soft_max@step")]
    assert len(probs) == 3 * eng.config.n_layers and all(r.passed for r in probs)
    assert res.first_divergence is None, res.first_divergence
