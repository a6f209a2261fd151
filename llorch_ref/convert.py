"""`llorch-ref convert --to gguf --dtype float32|float16 IN.gguf OUT.gguf`: a copy with every tensor dequantized.

Metadata is kept key by key (with its GGUF value type); only general.file_type changes. llama.cpp run on
the F32 copy computes plain float32 math, which is what the tight checkpoint bands are measured on.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import gguf
import numpy as np

from .dtypes import SHORT, dtype_name
from .errors import ParameterError, TokenizerError
from .loaders.default_model import FILENAME, default_model_path
from .loaders.gguf_file import GEMMA3_ROPE_BASE_LOCAL, GEMMA3_SWA_PERIOD, dequantize, load_gguf, open_reader
from .loaders.hf_folder import load_hf_folder
from .loaders.qk_rows import unpermute_qk
from .output_paths import check_output
from .tokenizer import PRE_TOKENIZERS, TOKEN_NORMAL, build_gpt2, from_gguf_metadata

FILE_TYPES = {"float32": 0, "float16": 1}   # llama_ftype ALL_F32, MOSTLY_F16
HF_FILES = ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json")


def _copy_fields(reader, writer, file_type, overrides=None):
    """reader: open_reader's GGUFFile (its metadata with their value types)."""
    overrides = dict(overrides or {})
    for key, val in reader.metadata.items():
        if key == "general.architecture":
            continue
        if key == "general.file_type":
            writer.add_uint32(key, file_type)
            continue
        vtype, sub = reader.value_types[key]
        if key in overrides:
            writer.add_key_value(key, overrides.pop(key), gguf.GGUFValueType(vtype))
            continue
        if vtype == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(key, val.tolist() if isinstance(val, np.ndarray) else list(val),
                                 gguf.GGUFValueType(vtype), sub_type=gguf.GGUFValueType(sub))
        else:
            writer.add_key_value(key, val, gguf.GGUFValueType(vtype))
    if "general.file_type" not in reader.metadata:
        writer.add_uint32("general.file_type", file_type)
    if overrides:
        raise ParameterError(f"metadata key(s) {', '.join(overrides)} not in the file; nothing to override")


def _write_gguf(writer, out) -> Path:
    """Write a filled GGUFWriter (made with no path) through out's staging file: nothing half-written is
    ever at the output, and nothing but the output is replaced."""
    with out.staged_file() as tmp:
        writer.write_header_to_file(path=tmp)
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    return out.path


def convert_gguf(src, dst, dtype="float32", overwrite=False, kv_overrides=None, tensor_fn=None) -> Path:
    """Write a dequantized copy. kv_overrides: {key: value} replaced in the metadata (same value type);
    tensor_fn(name, float32 array) -> array lets tools plant a change in chosen weights."""
    dtype = dtype_name(dtype, tuple(FILE_TYPES), "--dtype")
    src = Path(src)
    out = check_output(dst, inputs=[src], overwrite=overwrite)
    reader = open_reader(src)                  # one-line errors for a bad file; its metadata keep their value types
    arch = reader.metadata["general.architecture"]
    writer = gguf.GGUFWriter(None, arch)
    _copy_fields(reader, writer, FILE_TYPES[dtype], kv_overrides)
    for t in reader.tensors:
        arr = dequantize(t)
        if tensor_fn is not None:
            arr = np.ascontiguousarray(tensor_fn(t.name, arr), dtype=np.float32)
        if dtype == "float16" and arr.ndim >= 2:      # ggml keeps norms (1-D) in F32 in f16 files
            arr = arr.astype(np.float16)
        writer.add_tensor(t.name, arr)
    return _write_gguf(writer, out)


def _int_if_whole(x: float):
    """transformers types query_pre_attn_scalar as int: 16.000000000000004 (1/scale^2) -> 16."""
    return int(round(x)) if abs(x - round(x)) < 1e-9 * max(1.0, abs(x)) else x


def _gemma3_hf_config(cfg, base: dict) -> dict:
    """config.json of a Gemma3ForCausalLM (transformers 5 rope_parameters, and the transformers 4 keys)."""
    full = {"rope_type": "default", "rope_theta": cfg.rope_base}
    if cfg.rope_freq_scale != 1.0:
        full = {"rope_type": "linear", "factor": 1.0 / cfg.rope_freq_scale, "rope_theta": cfg.rope_base}
    local_base = cfg.rope_base_local if cfg.rope_base_local is not None else cfg.rope_base
    keep = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings",
            "bos_token_id", "eos_token_id", "_name_or_path", "torch_dtype", "architectures")
    return {**{k: base[k] for k in keep}, "model_type": "gemma3_text",
            "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": _int_if_whole(float(cfg.scale) ** -2),
            "sliding_window": cfg.sliding_window,
            "layer_types": ["sliding_attention" if cfg.is_local(i) else "full_attention" for i in range(cfg.n_layers)],
            "rope_parameters": {"full_attention": full, "sliding_attention": {"rope_type": "default",
                                                                              "rope_theta": local_base}},
            "rope_theta": cfg.rope_base, "rope_local_base_freq": local_base,
            "rope_scaling": None if full["rope_type"] == "default" else {"rope_type": "linear", "factor": full["factor"]},
            "final_logit_softcapping": None, "attn_logit_softcapping": None, "attention_bias": False}


def _hf_tokenizer_with_specials(tok):
    """The tokenizer.json to write: ours, plus a post-processor that adds BOS/EOS as the GGUF says, so that
    transformers (which reads tokenizer.json, not add_bos_token) tokenizes like llama.cpp."""
    from tokenizers import Tokenizer as HFTok
    from tokenizers import processors

    hf = HFTok.from_str(tok.hf.to_str())
    pre = [tok.tokens[tok.bos_id]] if tok.add_bos and tok.bos_id is not None else []
    post = [tok.tokens[tok.eos_id]] if tok.add_eos and tok.eos_id is not None else []
    if pre or post:
        ids = {t: i for t, i in ((tok.tokens[tok.bos_id], tok.bos_id) if pre else (None, None),
                                 (tok.tokens[tok.eos_id], tok.eos_id) if post else (None, None)) if t is not None}
        hf.post_processor = processors.TemplateProcessing(
            single=" ".join(pre + ["$A"] + post), pair=" ".join(pre + ["$A"] + post + pre + ["$B:1"] + post),
            special_tokens=list(ids.items()))
    return hf


def convert_gguf_to_hf(src, dst, overwrite=False) -> Path:
    """GGUF (llama) -> a Hugging Face folder: float32 safetensors with Wq/Wk rows un-permuted,
    config.json, tokenizer.json built from the GGUF vocabulary, tokenizer_config.json (special tokens,
    chat template) and generation_config.json. Written to DST.part and renamed when complete."""
    from safetensors.numpy import save_file

    src = Path(src)
    out = check_output(dst, kind="folder", inputs=[src], overwrite=overwrite, owned=HF_FILES, make_parents=True)
    m = load_gguf(src)
    cfg = m.config
    if cfg.rope_dim != cfg.head_dim:
        raise ParameterError(f"{src}: rope_dim={cfg.rope_dim} < head_dim={cfg.head_dim} (partial RoPE) has no "
                             f"Hugging Face llama equivalent")
    if cfg.rope_freq_factors is not None:
        raise ParameterError(f"{src}: per-pair RoPE frequency factors (rope_freqs.weight) have no exact Hugging Face "
                             f"rope_scaling form (llama3 scaling keeps its parameters, not the factors)")
    if cfg.rope_yarn_ramp is not None or cfg.rope_attn_factor != 1.0:
        raise ParameterError(f"{src}: YaRN and RoPE attention factors are not written to a Hugging Face config by "
                             f"this converter")
    tok = from_gguf_metadata(m.metadata, source=str(src))
    if tok is None:
        raise ParameterError(f"{src}: the model has no vocabulary (no_vocab); an HF folder needs a tokenizer")
    tok_config, gen_config = _hf_tokenizer_configs(cfg, tok)
    with out.staged_folder() as tmp:
        save_file(_hf_tensors(cfg, m.weights), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(_hf_config(cfg, tok, m.metadata, src), indent=2) + "\n")
        (tmp / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
        (tmp / "generation_config.json").write_text(json.dumps(gen_config, indent=2) + "\n")
        _hf_tokenizer_with_specials(tok).save(str(tmp / "tokenizer.json"))
    return out.path


def _gpt2_hf_tensors(cfg, w) -> dict:
    """GPT2LMHeadModel's tensors: Conv1D matrices [in, out] (ours transposed), Q | K | V fused with its bias."""
    t = {"transformer.wte.weight": w.tok_embd, "transformer.wpe.weight": w.pos_embd,
         "transformer.ln_f.weight": w.out_norm, "transformer.ln_f.bias": w.out_norm_b}
    if not cfg.tied_output:
        t["lm_head.weight"] = w.output
    for i, lw in enumerate(w.layers):
        p = f"transformer.h.{i}."
        t.update({p + "ln_1.weight": lw.attn_norm, p + "ln_1.bias": lw.attn_norm_b,
                  p + "attn.c_attn.weight": np.concatenate([lw.wq, lw.wk, lw.wv]).T,
                  p + "attn.c_attn.bias": np.concatenate([lw.bq, lw.bk, lw.bv]),
                  p + "attn.c_proj.weight": lw.wo.T, p + "attn.c_proj.bias": lw.bo,
                  p + "ln_2.weight": lw.ffn_norm, p + "ln_2.bias": lw.ffn_norm_b,
                  p + "mlp.c_fc.weight": lw.w_up.T, p + "mlp.c_fc.bias": lw.b_up,
                  p + "mlp.c_proj.weight": lw.w_down.T, p + "mlp.c_proj.bias": lw.b_down})
    return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in t.items()}


def _gpt2_hf_config(cfg, base: dict) -> dict:
    """config.json of a GPT2LMHeadModel."""
    keep = ("vocab_size", "bos_token_id", "eos_token_id", "_name_or_path", "torch_dtype", "tie_word_embeddings")
    return {**{k: base[k] for k in keep}, "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
            "n_embd": cfg.d_model, "n_layer": cfg.n_layers, "n_head": cfg.n_heads, "n_inner": cfg.d_ff,
            "n_positions": cfg.context_length, "layer_norm_epsilon": cfg.rms_eps, "activation_function": "gelu_new"}


def _hf_tensors(cfg, w) -> dict:
    """Our weights under Hugging Face names, float32: Q/K rows un-permuted, Gemma norms as w - 1, Phi-3's
    projections fused; GPT-2's as GPT2LMHeadModel holds them."""
    if cfg.arch == "gpt2":
        return _gpt2_hf_tensors(cfg, w)
    gemma = cfg.arch == "gemma3"
    # HF Gemma norms hold w - 1 (they compute x / rms * (1 + w)); ours hold the multiplier, as GGUF files do
    norm = (lambda a: a - np.float32(1)) if gemma else (lambda a: a)
    tensors = {"model.embed_tokens.weight": w.tok_embd, "model.norm.weight": norm(w.out_norm)}
    if not cfg.tied_output:
        tensors["lm_head.weight"] = w.output
    # llama GGUF rows are in adjacent pairs (llama.cpp's converter permuted them); qwen2 GGUF rows are as in HF
    unperm = (lambda a, n: a) if cfg.rope_style == "neox" else unpermute_qk
    for i, lw in enumerate(w.layers):
        p = f"model.layers.{i}."
        if cfg.qkv_bias:
            tensors.update({p + "self_attn.q_proj.bias": unperm(lw.bq[:, None], cfg.n_heads)[:, 0],
                            p + "self_attn.k_proj.bias": unperm(lw.bk[:, None], cfg.n_kv_heads)[:, 0],
                            p + "self_attn.v_proj.bias": lw.bv})
        if cfg.arch == "phi3":                     # fused: qkv rows Q | K | V, gate_up rows gate | up
            tensors.update({p + "self_attn.qkv_proj.weight": np.concatenate([lw.wq, lw.wk, lw.wv]),
                            p + "mlp.gate_up_proj.weight": np.concatenate([lw.w_gate, lw.w_up])})
        if gemma:                                  # four norms a layer: post_attention_layernorm is post-attention
            tensors.update({p + "self_attn.q_norm.weight": norm(lw.q_norm),
                            p + "self_attn.k_norm.weight": norm(lw.k_norm),
                            p + "pre_feedforward_layernorm.weight": norm(lw.ffn_norm),
                            p + "post_feedforward_layernorm.weight": norm(lw.post_ffn_norm)})
        tensors.update({
            p + "input_layernorm.weight": norm(lw.attn_norm),
            p + "self_attn.q_proj.weight": unperm(lw.wq, cfg.n_heads),
            p + "self_attn.k_proj.weight": unperm(lw.wk, cfg.n_kv_heads),
            p + "self_attn.v_proj.weight": lw.wv,
            p + "self_attn.o_proj.weight": lw.wo,
            p + "post_attention_layernorm.weight": norm(lw.post_attn_norm) if gemma else lw.ffn_norm,
            p + "mlp.gate_proj.weight": lw.w_gate,
            p + "mlp.up_proj.weight": lw.w_up,
            p + "mlp.down_proj.weight": lw.w_down,
        })
    if cfg.arch == "phi3":
        tensors = {k: v for k, v in tensors.items() if not k.endswith(("q_proj.weight", "k_proj.weight",
                                                                        "v_proj.weight", "gate_proj.weight",
                                                                        "up_proj.weight"))}
    return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in tensors.items()}


def _hf_config(cfg, tok, metadata, src) -> dict:
    config = {
        "architectures": [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "phi3": "Phi3ForCausalLM",
                           "gemma3": "Gemma3ForCausalLM", "gpt2": "GPT2LMHeadModel"}[cfg.arch]],
        "model_type": cfg.arch, "torch_dtype": "float32",
        "vocab_size": cfg.n_vocab, "hidden_size": cfg.d_model, "intermediate_size": cfg.d_ff,
        "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.context_length, "rms_norm_eps": cfg.rms_eps,
        "rope_theta": cfg.rope_base,
        "rope_scaling": None if cfg.rope_freq_scale == 1.0 else {"rope_type": "linear",
                                                                 "factor": 1.0 / cfg.rope_freq_scale}, "tie_word_embeddings": cfg.tied_output,
        "hidden_act": "silu",
        **({"attention_bias": False, "mlp_bias": False} if cfg.arch == "llama" else
           {"use_sliding_window": False} if cfg.arch == "qwen2" else {"sliding_window": None}),
        "bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id,
        "_name_or_path": str(metadata.get("general.name") or src.stem),
    }
    if cfg.arch == "gemma3":
        config = _gemma3_hf_config(cfg, config)
    if cfg.arch == "gpt2":
        config = _gpt2_hf_config(cfg, config)
    return config


def _hf_tokenizer_configs(cfg, tok) -> tuple[dict, dict]:
    name = lambda i: tok.tokens[i] if i is not None else None
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": name(tok.bos_id), "eos_token": name(tok.eos_id),
        "add_bos_token": bool(tok.add_bos), "add_eos_token": bool(tok.add_eos),
        "chat_template": tok.chat_template, "model_max_length": cfg.context_length,
        "clean_up_tokenization_spaces": False,
    }
    eog = sorted(tok.eog_ids)
    gen_config = {"bos_token_id": tok.bos_id, "eos_token_id": eog if len(eog) > 1 else tok.eos_id}
    return tok_config, gen_config


# Probe texts for identifying a byte-level BPE pre-tokenizer by what it does (as llama.cpp's converter
# identifies one by the hash of its output on a test text).
PRE_PROBES = ["Hello, world! It's 2026; we've 12345 items, they'll say 3.14159.",
              "  two  spaces\tand\nnewlines\n\n\nend", "ünïcödé 日本語 🙂 café", "def f(x):\n    return x**2  # ok",
              "ABC'S DON'T I'M 1,000,000 + 22 = 1000022 ..."]


def _detect_pre(hf, tokens, types, merges, where) -> str:
    want = [hf.encode(t, add_special_tokens=False).ids for t in PRE_PROBES]
    # one name per distinct pre-tokenizer, the more specific first: where a vocabulary cannot tell two apart
    # (no multi-digit tokens: 'smollm' and 'gpt-2' split alike), the first that matches is written
    for name in ("llama-bpe", "qwen2", "smollm", "dbrx", "gpt-2", "default"):
        cand = build_gpt2(tokens, types, merges, name)
        if [cand.encode(t, add_special_tokens=False).ids for t in PRE_PROBES] == want:
            return name
    raise TokenizerError(f"{where}: the tokenizer's pre-tokenizer splits text like none of the llama.cpp "
                         f"pre-tokenizers llorch-ref implements ({', '.join(sorted(PRE_TOKENIZERS))})")


def _check_gemma3_for_llamacpp(cfg, src):
    """What a gemma3 GGUF cannot say, refused rather than written wrong: llama.cpp takes the local layers
    from a period of 6, the local RoPE base 10000 and the attention scale 1/sqrt(Hd) (1/sqrt(D/H) at 62 layers)."""

    period = tuple(i % GEMMA3_SWA_PERIOD < GEMMA3_SWA_PERIOD - 1 for i in range(cfg.n_layers))
    scale = (cfg.d_model / cfg.n_heads) ** -0.5 if cfg.n_layers == 62 else cfg.head_dim ** -0.5
    problems = []
    if tuple(cfg.local_layers or ()) != period:
        problems.append("local layers other than 5 of every 6")
    if cfg.rope_base_local != GEMMA3_ROPE_BASE_LOCAL:
        problems.append(f"local RoPE base {cfg.rope_base_local} (llama.cpp uses {GEMMA3_ROPE_BASE_LOCAL})")
    if abs(cfg.scale - scale) > 1e-12 * scale:
        problems.append(f"attention scale {cfg.scale} (query_pre_attn_scalar {cfg.scale ** -2:g}; llama.cpp uses {scale})")
    if problems:
        raise ParameterError(f"{src}: this Gemma 3 model has no gemma3 GGUF form: " + "; ".join(problems))


def convert_hf_to_gguf(src, dst, dtype="float32", overwrite=False) -> Path:
    """Hugging Face llama folder -> GGUF (F32, or F16 for 2-D weights), as llama.cpp's converter writes it:
    Wq/Wk rows permuted to adjacent RoPE pairs, tokenizer metadata (gpt2 with the pre-tokenizer identified by
    its behaviour, or llama/SentencePiece with scores from the BPE merge ranks), chat template, special ids,
    RoPE scaling (linear, or llama3 as rope_freqs.weight)."""
    dtype = dtype_name(dtype, tuple(FILE_TYPES), "--dtype")
    src = Path(src)
    out = check_output(dst, inputs=[src], overwrite=overwrite)
    m = load_hf_folder(src)              # Wq/Wk rows already in the canonical adjacent layout = llama.cpp's
    cfg, w, tok = m.config, m.weights, m.tokenizer
    if cfg.rope_attn_factor != 1.0 or cfg.rope_by_length or cfg.rope_yarn_ramp is not None:
        raise ParameterError(f"{src}: YaRN, LongRoPE and dynamic NTK RoPE scaling are not written to GGUF by "
                             f"this converter")
    model_json = json.loads(tok.hf.to_str())["model"]
    merges = [" ".join(x) if isinstance(x, list) else x for x in model_json.get("merges", [])]
    wr = gguf.GGUFWriter(None, cfg.arch)
    _gguf_hparams(wr, cfg, m.metadata, src, dtype)
    _gguf_tokenizer(wr, tok, model_json, merges, src)
    _gguf_tensors(wr, cfg, w, dtype)
    return _write_gguf(wr, out)


def _gguf_hparams(wr, cfg, metadata, src, dtype):
    wr.add_name(str(metadata.get("_name_or_path") or src.name))
    wr.add_block_count(cfg.n_layers)
    wr.add_context_length(cfg.context_length)
    wr.add_embedding_length(cfg.d_model)
    wr.add_feed_forward_length(cfg.d_ff)
    wr.add_head_count(cfg.n_heads)
    wr.add_head_count_kv(cfg.n_kv_heads)
    if cfg.head_dim != cfg.d_model // cfg.n_heads:
        wr.add_key_length(cfg.head_dim)
        wr.add_value_length(cfg.head_dim)
    if cfg.arch == "gpt2":                          # LayerNorm, learned positions: no RoPE keys
        wr.add_layer_norm_eps(cfg.rms_eps)
    else:
        wr.add_layer_norm_rms_eps(cfg.rms_eps)
        wr.add_rope_freq_base(cfg.rope_base)
        wr.add_rope_dimension_count(cfg.rope_dim)
    if cfg.rope_freq_scale != 1.0:
        wr.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        wr.add_rope_scaling_factor(1.0 / cfg.rope_freq_scale)
    if cfg.arch == "gemma3":
        _check_gemma3_for_llamacpp(cfg, src)
        wr.add_sliding_window(cfg.sliding_window)
    wr.add_vocab_size(cfg.n_vocab)
    wr.add_file_type(FILE_TYPES[dtype])

def _gguf_tokenizer(wr, tok, model_json, merges, src):
    if tok.kind == "gpt2":
        wr.add_tokenizer_model("gpt2")
        wr.add_tokenizer_pre(_detect_pre(tok.hf, tok.tokens, tok.token_types, merges, src))
        wr.add_token_merges(merges)
    else:
        rank = {}
        for r, mg in enumerate(merges):
            rank.setdefault(mg.replace(" ", ""), r)
        scores = [-float(rank.get(t, len(merges) + i)) if tok.token_types[i] == TOKEN_NORMAL else 0.0
                  for i, t in enumerate(tok.tokens)]
        wr.add_tokenizer_model("llama")
        wr.add_token_scores(scores)
        wr.add_add_space_prefix(bool(tok.add_space_prefix))
        unk = tok.hf.token_to_id(model_json.get("unk_token") or "<unk>")
        if unk is not None:
            wr.add_unk_token_id(unk)
    wr.add_token_list(tok.tokens)
    wr.add_token_types(tok.token_types)
    if tok.bos_id is not None:
        wr.add_bos_token_id(tok.bos_id)
    if tok.eos_id is not None:
        wr.add_eos_token_id(tok.eos_id)
    wr.add_add_bos_token(bool(tok.add_bos))
    wr.add_add_eos_token(bool(tok.add_eos))
    if tok.chat_template:
        wr.add_chat_template(tok.chat_template)

def _gguf_tensors(wr, cfg, w, dtype):
    big = (lambda a: a.astype(np.float16)) if dtype == "float16" else (lambda a: a)
    wr.add_tensor("token_embd.weight", big(np.ascontiguousarray(w.tok_embd, dtype=np.float32)))
    for i, lw in enumerate(w.layers):
        p = f"blk.{i}."
        if cfg.arch == "gpt2":                     # as llama.cpp's gpt2 graph reads them: fused Q|K|V, all biased
            parts = gpt2_layer_tensors(lw)
        elif cfg.arch == "phi3":                   # fused, as llama.cpp's phi3 graph reads them
            parts = (("attn_norm", lw.attn_norm), ("attn_qkv", np.concatenate([lw.wq, lw.wk, lw.wv])),
                     ("attn_output", lw.wo), ("ffn_norm", lw.ffn_norm),
                     ("ffn_up", np.concatenate([lw.w_gate, lw.w_up])), ("ffn_down", lw.w_down))
        else:
            parts = (("attn_norm", lw.attn_norm), ("attn_q", lw.wq), ("attn_k", lw.wk), ("attn_v", lw.wv),
                     ("attn_output", lw.wo), ("ffn_norm", lw.ffn_norm), ("ffn_gate", lw.w_gate),
                     ("ffn_up", lw.w_up), ("ffn_down", lw.w_down))
        if cfg.arch == "gemma3":                   # norm multipliers (1 + w), as llama.cpp's converter writes them
            parts += (("attn_q_norm", lw.q_norm), ("attn_k_norm", lw.k_norm),
                      ("post_attention_norm", lw.post_attn_norm), ("post_ffw_norm", lw.post_ffn_norm))
        for name, arr in parts:
            a = np.ascontiguousarray(arr, dtype=np.float32)
            full = name if name.endswith((".weight", ".bias")) else name + ".weight"     # GPT-2's name their own
            wr.add_tensor(p + full, big(a) if a.ndim == 2 else a)
        if cfg.qkv_bias and cfg.arch != "gpt2":
            for name, arr in (("attn_q", lw.bq), ("attn_k", lw.bk), ("attn_v", lw.bv)):
                wr.add_tensor(p + name + ".bias", np.ascontiguousarray(arr, dtype=np.float32))
    wr.add_tensor("output_norm.weight", np.ascontiguousarray(w.out_norm, dtype=np.float32))
    if cfg.arch == "gpt2":
        wr.add_tensor("output_norm.bias", np.ascontiguousarray(w.out_norm_b, dtype=np.float32))
        wr.add_tensor("position_embd.weight", big(np.ascontiguousarray(w.pos_embd, dtype=np.float32)))
    if not cfg.tied_output:
        wr.add_tensor("output.weight", big(np.ascontiguousarray(w.output, dtype=np.float32)))
    if cfg.rope_freq_factors is not None:
        wr.add_tensor("rope_freqs.weight", np.asarray(cfg.rope_freq_factors, dtype=np.float32))


def gpt2_layer_tensors(lw) -> tuple:
    """(GGUF name without blk.N., array) of one GPT-2 layer: weights as ".weight", biases as ".bias"."""
    return (("attn_norm.weight", lw.attn_norm), ("attn_norm.bias", lw.attn_norm_b),
            ("attn_qkv.weight", np.concatenate([lw.wq, lw.wk, lw.wv])),
            ("attn_qkv.bias", np.concatenate([lw.bq, lw.bk, lw.bv])),
            ("attn_output.weight", lw.wo), ("attn_output.bias", lw.bo),
            ("ffn_norm.weight", lw.ffn_norm), ("ffn_norm.bias", lw.ffn_norm_b),
            ("ffn_up.weight", lw.w_up), ("ffn_up.bias", lw.b_up),
            ("ffn_down.weight", lw.w_down), ("ffn_down.bias", lw.b_down))


def default_model_copy(dtype="float32") -> Path:
    """A dequantized copy of the default model (llorch-ref convert), cached next to it."""
    src = default_model_path()
    dtype = dtype_name(dtype, tuple(FILE_TYPES))
    kind = SHORT[dtype].upper()                       # the GGUF type name: F32, F16
    dst = src.with_name(FILENAME.replace("Q4_1", kind))
    if not dst.exists():
        print(f"llorch-ref: writing the {kind} copy of the default model to {dst}", file=sys.stderr)
        convert_gguf(src, dst, dtype=dtype)
    return dst
