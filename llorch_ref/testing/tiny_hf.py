"""Tiny random Hugging Face models made with transformers (seeded), one per supported architecture, with a
tokenizer.json from a tiny vocabulary (llorch_ref.testing.tiny). Needs torch and transformers."""
from __future__ import annotations

import json
from pathlib import Path

from ..convert import convert_gguf_to_hf
from .tiny import write_tiny_model

ARCHS = {
    # Llama 2 style: multi-head attention, untied output
    "llama2": dict(model_type="llama", pre="llama-bpe", kw=dict(num_key_value_heads=4, tie_word_embeddings=False)),
    # Llama 3 style: grouped-query attention, llama3 RoPE scaling, large rope theta
    "llama3": dict(model_type="llama", pre="llama-bpe",
                   kw=dict(num_key_value_heads=2, tie_word_embeddings=False, rope_theta=500000.0,
                           rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0, "original_max_position_embeddings": 32})),
    # Mistral: llama with a sliding window (64 here, so the context is capped to it)
    "mistral": dict(model_type="mistral", pre="llama-bpe",
                    kw=dict(num_key_value_heads=2, tie_word_embeddings=False, sliding_window=64)),
    # Phi-3: fused qkv and gate|up projections, NeoX RoPE in llama.cpp
    "phi3": dict(model_type="phi3", vocab="spm",                        # Phi-3's own vocabulary is SentencePiece
                 kw=dict(num_key_value_heads=2, tie_word_embeddings=False, sliding_window=None, pad_token_id=None)),
    # Qwen2: Q/K/V biases, NeoX RoPE in llama.cpp, tied output
    "qwen2": dict(model_type="qwen2", pre="qwen2",
                  kw=dict(num_key_value_heads=2, tie_word_embeddings=True, rope_theta=1000000.0, rms_norm_eps=1e-6,
                          use_sliding_window=False)),
    # Gemma 3: six layers so that one is global (every 6th); a window of 8 tokens, shorter than the test prompts
    "gemma3": dict(model_type="gemma3_text", vocab="spm", n_layers=6,
                   kw=dict(num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
                           tie_word_embeddings=True, rms_norm_eps=1e-6,
                           rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                                            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})),
    # GPT-2: LayerNorm with biases, learned positions, fused biased Q|K|V, biased MLP with tanh GELU, tied output
    "gpt2": dict(model_type="gpt2", pre="gpt-2", kw={}),
}


def write_tiny_hf(out, arch="llama2", seed=0):
    """-> (folder, the transformers model in eval mode). Deterministic for (arch, seed)."""
    import torch
    import transformers

    spec = ARCHS[arch]
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    g = write_tiny_model(out.parent / f".{out.name}-vocab.gguf", vocab=spec.get("vocab", "bpe"),
                         **({"pre": spec["pre"]} if "pre" in spec else {}))
    convert_gguf_to_hf(g, out, overwrite=True)            # tokenizer.json, tokenizer_config.json from the vocabulary
    g.unlink()
    n_vocab = json.loads((out / "config.json").read_text())["vocab_size"]
    torch.manual_seed(seed)
    if spec["model_type"] == "gpt2":
        return out, _save_tiny(out, _tiny_gpt2(transformers, torch, n_vocab, out), spec)
    cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
           "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
           "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
           "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM),
           "gemma3_text": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM)}[spec["model_type"]]
    cfg = cls[0](vocab_size=n_vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=spec.get("n_layers", 2),
                 num_attention_heads=4, max_position_embeddings=128, **spec["kw"])
    model = cls[1](cfg).eval()
    gemma = spec["model_type"] == "gemma3_text"      # Gemma norms hold w - 1: centred on 0
    with torch.no_grad():            # transformers initializes biases to zero and norms to one: make them count
        for lyr in model.model.layers:
            norms = [lyr.input_layernorm, lyr.post_attention_layernorm]
            if gemma:
                norms += [lyr.pre_feedforward_layernorm, lyr.post_feedforward_layernorm, lyr.self_attn.q_norm,
                          lyr.self_attn.k_norm]
            for nm in norms:
                nm.weight.normal_(0.0 if gemma else 1.0, 0.1)
            for lin in [getattr(lyr.self_attn, n) for n in ("q_proj", "k_proj", "v_proj") if hasattr(lyr.self_attn, n)]:
                if lin.bias is not None:
                    lin.bias.normal_(0.0, 0.5)
    return out, _save_tiny(out, model, spec)


def _tiny_gpt2(transformers, torch, n_vocab, out):
    """GPT2LMHeadModel of the same size as the others (D 64, F 96, 4 heads, 2 layers, 128 positions): norm
    weights, norm biases and every projection's bias randomized (transformers sets them to one and zero), the
    MLP's bias wide enough that GELU's tanh approximation differs measurably from the exact erf form; weights
    drawn at std 0.2 (GPT-2's own 0.02 leaves the tied logits to one token: greedy text repeats it)."""
    bos, eos, _ = cfg_bos_eos(out)
    cfg = transformers.GPT2Config(vocab_size=n_vocab, n_embd=64, n_inner=96, n_layer=2, n_head=4, n_positions=128,
                                  activation_function="gelu_new", bos_token_id=bos, eos_token_id=eos,
                                  initializer_range=0.2)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():
        for nm in [m for lyr in model.transformer.h for m in (lyr.ln_1, lyr.ln_2)] + [model.transformer.ln_f]:
            nm.weight.normal_(1.0, 0.1)
            nm.bias.normal_(0.0, 0.1)
        for lyr in model.transformer.h:
            for lin, std in ((lyr.attn.c_attn, 0.5), (lyr.attn.c_proj, 0.1), (lyr.mlp.c_fc, 1.0),
                             (lyr.mlp.c_proj, 0.1)):
                lin.bias.normal_(0.0, std)
    return model


def _save_tiny(out, model, spec):
    (out / "model.safetensors").unlink()
    (out / "config.json").unlink()
    model.save_pretrained(str(out), safe_serialization=True)
    gemma = spec["model_type"] == "gemma3_text"
    # llama.cpp keys tokenizer tweaks on the model *name*: a name containing "phi3" makes it look up
    # </s>, <unk>, <s> and <|endoftext|>, which a real Phi-3 vocabulary has and this tiny one does not
    c = json.loads((out / "config.json").read_text())
    c["_name_or_path"] = f"tiny-random-{spec['model_type'].replace('phi3', 'p3')}"
    if gemma:
        c["bos_token_id"], c["eos_token_id"], c["pad_token_id"] = cfg_bos_eos(out)
    (out / "config.json").write_text(json.dumps(c, indent=2))
    return model


def cfg_bos_eos(folder):
    """(bos, eos, pad) ids of the tiny vocabulary (Gemma3TextConfig defaults to Gemma's own 2, 1, 0)."""
    tc = json.loads((Path(folder) / "tokenizer_config.json").read_text())
    from tokenizers import Tokenizer
    t = Tokenizer.from_file(str(Path(folder) / "tokenizer.json"))
    return t.token_to_id(tc["bos_token"]), t.token_to_id(tc["eos_token"]), None
