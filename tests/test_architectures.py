"""Architectures as adapters: tiny random transformers models (Llama 2 style, Llama 3 style, Mistral, Qwen2, Phi-3,
Gemma 3), converted to GGUF by llorch-ref, checked on every checkpoint against transformers and llama.cpp."""
from __future__ import annotations

import dataclasses

import pytest
from llorch_test_helpers import tiny_hf_gguf

import llorch_ref

PROMPT = "Once upon a time, there was a little"


@pytest.fixture(scope="module", params=["llama2", "llama3", "mistral", "qwen2", "phi3", "gemma3"])
def arch_model(request, tmp_path_factory):
    folder, g, _ = tiny_hf_gguf(tmp_path_factory.mktemp("arch"), request.param)
    return request.param, folder, g


@pytest.mark.llamacpp
def test_every_checkpoint_against_llamacpp(llamacpp, arch_model):
    from llorch_ref.harness.run import run_diff
    arch, folder, g = arch_model
    res = run_diff(llorch_ref.load(g), prompt=PROMPT, n_greedy=16)
    assert res.band_class == "F32"
    assert res.first_divergence is None, res.first_divergence
    assert res.greedy["equal_prefix"] == 16
    # llama.cpp leaves some nodes unnamed (Qwen2's, Phi-3's and Gemma 3's output projection, Phi-3's residual):
    # reported, not passed
    assert {u["tensor"] for u in res.not_covered} == {"qwen2": {"attn_out"}, "phi3": {"attn_out", "ffn_inp"},
                                                      "gemma3": {"attn_out"}}.get(arch, set())
    # Gemma 3: llama.cpp's GEGLU reads GELU from a float16 table, so F16 bands apply from its output on (said
    # in a warning); everything before it in layer 0 met the F32 bands
    assert bool(res.warnings) == (arch == "gemma3")
    if arch == "gemma3":
        assert "float16 table" in res.warnings[0]
        spec = {s.id: s for s in res.specs}
        early = [r for r in res.rows if r.layer == 0 and r.order < (1, 0, 0, 70)]    # (phase, step, layer, place)
        assert len(early) > 10 and all(r.band == spec[r.checkpoint].band("F32") for r in early)
        assert all(r.band == spec[r.checkpoint].band("F16") for r in res.rows if r.layer is not None and r.layer > 0)


def test_every_checkpoint_against_transformers(arch_model):
    from llorch_ref.harness.compare import compare_dumps
    from llorch_ref.references.engines import dump_transformers
    from llorch_ref.references.llorch import record_engine
    arch, folder, g = arch_model
    for path in (g, folder):                                  # the GGUF path and the HF-folder path
        eng = llorch_ref.load(path)
        ids = eng.tokenizer.encode(PROMPT)
        res = compare_dumps(record_engine(eng, ids, prompt=PROMPT, n_greedy=8),
                            dump_transformers(folder, prompt=PROMPT, token_ids=ids, n_greedy=8), eng.config, "F32")
        assert res.first_divergence is None, (path, res.first_divergence)
        assert res.greedy["equal_prefix"] == 8


def test_a_dropped_architecture_switch_is_caught(arch_model):
    """Planted bugs: Qwen2 without its Q/K/V biases, Llama 3 without its RoPE frequency factors, Phi-3 with the
    halves of its fused gate|up projection swapped."""
    from llorch_ref.harness.compare import compare_dumps
    from llorch_ref.references.engines import dump_transformers
    from llorch_ref.references.llorch import record_engine
    arch, folder, g = arch_model
    eng = llorch_ref.load(g)
    if arch == "qwen2":
        eng.config, where = dataclasses.replace(eng.config, qkv_bias=False), ("2", 0, "q_proj")
    elif arch == "llama3":
        eng.config, where = dataclasses.replace(eng.config, rope_freq_factors=None), ("1B", 0, "q")
    elif arch == "phi3":
        lw = eng.weights.layers[0]
        lw.w_gate, lw.w_up = lw.w_up, lw.w_gate
        where = ("6", 0, "ffn_swiglu")
    elif arch == "gemma3":      # no sliding window: the 12-token prompt is longer than the window of 8
        eng.config, where = dataclasses.replace(eng.config, sliding_window=10**6), ("4", 0, "kq_soft_max")
    else:
        pytest.skip(f"{arch} has no switch beyond the llama defaults")
    ids = eng.tokenizer.encode(PROMPT)
    res = compare_dumps(record_engine(eng, ids, n_greedy=0), dump_transformers(folder, token_ids=ids, n_greedy=0),
                        eng.config, "F32")
    fd = res.first_divergence
    assert fd is not None and (fd["checkpoint"], fd["layer"], fd["tensor"]) == where


def test_qwen2_sliding_window_is_refused(tmp_path):
    from llorch_ref.errors import UnsupportedModelError
    from llorch_ref.loaders.hf_folder import config_from_hf
    c = {"model_type": "qwen2", "vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 1,
         "num_attention_heads": 2, "intermediate_size": 16, "use_sliding_window": True}
    with pytest.raises(UnsupportedModelError, match="sliding-window"):
        config_from_hf(c, tmp_path)
    c["use_sliding_window"] = False
    cfg = config_from_hf(c, tmp_path)
    assert cfg.arch == "qwen2" and cfg.qkv_bias


def test_mistral_context_is_capped_at_its_sliding_window(arch_model):
    arch, folder, g = arch_model
    if arch != "mistral":
        pytest.skip("only Mistral has a sliding window")
    from llorch_ref.errors import PromptError
    eng = llorch_ref.load(folder)
    assert eng.config.context_length == 64 and eng.n_ctx == 64        # max_position_embeddings is 128
    with pytest.raises(PromptError, match="context holds 64"):
        eng.logits(list(range(3, 70)))


def test_lazy_streaming_layers_equal_eager_for_every_architecture(arch_model):
    """Streaming layers rebuild fused (Phi-3), biased (Qwen2), permuted (llama) and shifted-norm (Gemma 3) weights
    field by field."""
    import numpy as np
    arch, folder, g = arch_model
    for path in (folder, g):
        eager = llorch_ref.load(path, weights="eager")
        ids = eager.tokenizer.encode(PROMPT)
        lazy = llorch_ref.load(path, weights="lazy", weight_cache_mb=0)
        np.testing.assert_array_equal(lazy.logits(ids), eager.logits(ids))
