"""Hugging Face model folders -> the canonical Config + Weights + Tokenizer.

A folder holds config.json, model.safetensors (or model.safetensors.index.json and its shards),
tokenizer.json, tokenizer_config.json (special tokens, chat template) and optionally generation_config.json.
Hugging Face Llama weights keep Wq/Wk rows in the half-split ("neox") layout. By default the loader
permutes them into the canonical adjacent-pair layout the GGUF path uses (what llama.cpp's converter
does), so both paths run the same arithmetic in the same order and give bit-identical logits;
qk_layout="neox" keeps the rows as stored and runs RoPE half-split instead (same math, other summation
order). Config.rope_style records which, and Config.extra["qk_rows_stored"] says what the file held.

Only the plain `llama` model type is read today; anything in config.json that would change the math
and is not implemented (rope_scaling, attention or MLP biases, other activations) is rejected by name.
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..config import Config
from ..errors import ModelFileError, ParameterError, TokenizerError, UnsupportedModelError
from ..model.layers import longrope_attn_factor, yarn_attn_factor, yarn_ramp
from ..model.weights import LayerWeights, Weights
from ..tokenizer import TOKEN_BYTE, TOKEN_CONTROL, TOKEN_NORMAL, Tokenizer
from .gguf_file import FUSED_OF, split_fused
from .lazy_weights import LazyLayers, LazyRows, LazyWeights, WeightCache, default_cache_bytes, storage_dtype
from .qk_rows import permute_qk

HF_LAYER_TENSORS = {  # HF name suffix -> LayerWeights field (NumPy shape checked against the config)
    "input_layernorm.weight": "attn_norm",
    "self_attn.q_proj.weight": "wq",
    "self_attn.k_proj.weight": "wk",
    "self_attn.v_proj.weight": "wv",
    "self_attn.o_proj.weight": "wo",
    "post_attention_layernorm.weight": "ffn_norm",
    "mlp.gate_proj.weight": "w_gate",
    "mlp.up_proj.weight": "w_up",
    "mlp.down_proj.weight": "w_down",
}
GEMMA3_LAYER_TENSORS = {  # Gemma 3 (model_type gemma3_text): four norms per layer, QK-norm
    **{k: v for k, v in HF_LAYER_TENSORS.items() if k != "post_attention_layernorm.weight"},
    "post_attention_layernorm.weight": "post_attn_norm",
    "pre_feedforward_layernorm.weight": "ffn_norm",
    "post_feedforward_layernorm.weight": "post_ffn_norm",
    "self_attn.q_norm.weight": "q_norm",
    "self_attn.k_norm.weight": "k_norm",
}
GEMMA_NORMS = ("attn_norm", "ffn_norm", "post_attn_norm", "post_ffn_norm", "q_norm", "k_norm")  # stored as w - 1
HF_BIAS_TENSORS = {"self_attn.q_proj.bias": "bq", "self_attn.k_proj.bias": "bk", "self_attn.v_proj.bias": "bv"}
HF_ARCHS = ("llama", "mistral", "qwen2", "phi3", "gemma3_text", "gpt2")   # mistral, phi3: a sliding window caps the context
GPT2_LAYER_TENSORS = {  # GPT2LMHeadModel, under transformer.h.{i}. (hub files: h.{i}.): HF suffix -> our field
    "ln_1.weight": "attn_norm", "ln_1.bias": "attn_norm_b",
    "attn.c_attn.weight": "_qkv", "attn.c_attn.bias": "_qkv_b",            # fused Q | K | V
    "attn.c_proj.weight": "wo", "attn.c_proj.bias": "bo",
    "ln_2.weight": "ffn_norm", "ln_2.bias": "ffn_norm_b",
    "mlp.c_fc.weight": "w_up", "mlp.c_fc.bias": "b_up",
    "mlp.c_proj.weight": "w_down", "mlp.c_proj.bias": "b_down",
}
GPT2_CONV1D = ("_qkv", "wo", "w_up", "w_down")     # GPT-2's Conv1D matrices are stored [in, out]
GPT2_ACTS = ("gelu_new", "gelu_pytorch_tanh")      # both are the tanh approximation
HF_FUSED_TENSORS = {"self_attn.qkv_proj.weight": "_qkv", "mlp.gate_up_proj.weight": "_gate_up"}   # phi3
SAFETENSORS_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}


@dataclass
class HFModel:
    path: Path
    config: Config
    weights: Weights
    tokenizer: object
    metadata: dict = field(default_factory=dict)       # config.json, for display
    tensor_types: dict = field(default_factory=dict)   # HF tensor name -> safetensors dtype


def _read_json(path: Path, required=True):
    if not path.exists():
        if required:
            raise ModelFileError(f"{path}: missing (a Hugging Face model folder needs it)")
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelFileError(f"{path}: not valid JSON ({e})") from None


def config_from_hf(c: dict, where: Path, qk_layout: str = "adjacent") -> Config:
    mt = c.get("model_type")
    if mt == "gemma3":
        raise UnsupportedModelError(f"{where}: model_type 'gemma3' is Gemma 3's multimodal model; only the text "
                                    f"model (Gemma3ForCausalLM, model_type 'gemma3_text') is supported")
    if mt == "gemma3_text":
        return _gemma3_config(c, where)
    if mt == "gpt2":
        return _gpt2_config(c, where)
    if mt not in HF_ARCHS:
        raise UnsupportedModelError(f"{where}: model_type {mt!r} is not supported yet (supported: "
                                    f"{', '.join(HF_ARCHS)})")
    if mt == "qwen2" and c.get("use_sliding_window"):
        raise UnsupportedModelError(f"{where}: use_sliding_window=true (Qwen2 sliding-window attention) is not "
                                    f"implemented")
    window = c.get("sliding_window") if mt in ("mistral", "phi3") else None
    for key, ok in (("attention_bias", False), ("mlp_bias", False),
                    ("hidden_act", "silu"), ("pretraining_tp", 1)):
        if c.get(key) is not None and c[key] != ok:
            raise UnsupportedModelError(f"{where}: {key}={c[key]!r} is not implemented for llama folders "
                                        f"(supported: {ok!r})")
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"):
        if key not in c:
            raise ModelFileError(f"{where}: required key {key!r} is missing")
    d, h = int(c["hidden_size"]), int(c["num_attention_heads"])
    hd = int(c.get("head_dim") or d // h)
    rp = c.get("rope_scaling") or c.get("rope_parameters") or {}         # transformers 5 writes rope_parameters
    base = float(rp.get("rope_theta", c.get("rope_theta", 10000.0)))
    rope_dim = int(hd * float(rp.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0))))
    rope = rope_fields_from_hf(c, rp, base, rope_dim, where)
    ctx = rope.pop("context_length", int(c.get("max_position_embeddings", 2048)))
    if window:      # Mistral's sliding window: exact as long as no sequence is longer than the window
        ctx = min(ctx, int(window))
    return Config(
        arch="llama" if mt == "mistral" else mt,          # llama.cpp runs Mistral as llama, so do we
        rope_dim=rope_dim,
        qkv_bias=(mt == "qwen2"),
        n_vocab=int(c["vocab_size"]),
        d_model=d,
        n_layers=int(c["num_hidden_layers"]),
        n_heads=h,
        n_kv_heads=int(c.get("num_key_value_heads") or h),       # HF default: MHA
        head_dim=hd,
        d_ff=int(c["intermediate_size"]),
        context_length=ctx,
        rms_eps=float(np.float32(c.get("rms_norm_eps", 1e-6))),  # LlamaConfig's default
        rope_base=base,
        **rope,
        rope_style=qk_layout,                                    # stored: HF rotate_half pairs (i, i + Hd/2)
        tied_output=bool(c.get("tie_word_embeddings", False)),   # LlamaConfig's default
        attention_scale=None,
        extra={"general.name": c.get("_name_or_path"), "source": "hf", "qk_rows_stored": "neox", "model_type": mt,
               **({"sliding_window": int(window)} if window else {})},
    )


def _gemma3_config(c: dict, where: Path) -> Config:
    """Gemma3TextConfig -> Config. Local (sliding-window) layers from layer_types (or the older
    sliding_window_pattern); RoPE per layer type from rope_parameters (transformers 5) or rope_theta,
    rope_local_base_freq and rope_scaling (transformers 4); attention scale query_pre_attn_scalar^-1/2."""
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if c.get(key) is not None:
            raise UnsupportedModelError(f"{where}: {key}={c[key]} is not implemented (Gemma 3 has none)")
    if c.get("use_bidirectional_attention"):
        raise UnsupportedModelError(f"{where}: use_bidirectional_attention=true is not implemented")
    if c.get("attention_bias"):
        raise UnsupportedModelError(f"{where}: attention_bias=true is not implemented for gemma3_text")
    act = c.get("hidden_activation") or c.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise UnsupportedModelError(f"{where}: hidden_activation={act!r} is not implemented (supported: "
                                    f"gelu_pytorch_tanh)")
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                "sliding_window"):
        if c.get(key) is None:
            raise ModelFileError(f"{where}: required key {key!r} is missing")
    d, h, n = int(c["hidden_size"]), int(c["num_attention_heads"]), int(c["num_hidden_layers"])
    hd = int(c.get("head_dim") or 256)                       # Gemma3TextConfig's default
    types = c.get("layer_types")
    if types is None:
        period = int(c.get("sliding_window_pattern") or c.get("_sliding_window_pattern") or 6)
        types = ["full_attention" if (i + 1) % period == 0 else "sliding_attention" for i in range(n)]
    if len(types) != n or set(types) - {"sliding_attention", "full_attention"}:
        raise ModelFileError(f"{where}: layer_types must list {n} entries of sliding_attention|full_attention")
    rp = c.get("rope_parameters")
    if isinstance(rp, dict) and "full_attention" in rp:
        full, local = rp["full_attention"], rp.get("sliding_attention") or {}
    else:
        full = dict(c.get("rope_scaling") or {}, rope_theta=c.get("rope_theta", 1000000.0))
        local = {"rope_theta": c.get("rope_local_base_freq", 10000.0)}
    if (local.get("rope_type") or "default") != "default":
        raise UnsupportedModelError(f"{where}: RoPE scaling on the sliding-window layers is not implemented")
    base = float(full.get("rope_theta", 1000000.0))
    freq_scale, factors = rope_scaling_from_hf(full, base, hd, where)
    return Config(
        arch="gemma3", n_vocab=int(c["vocab_size"]), d_model=d, n_layers=n, n_heads=h,
        n_kv_heads=int(c.get("num_key_value_heads") or h), head_dim=hd, d_ff=int(c["intermediate_size"]),
        context_length=int(c.get("max_position_embeddings", 131072)),
        rms_eps=float(np.float32(c.get("rms_norm_eps", 1e-6))), rope_base=base, rope_dim=hd,
        rope_style="neox", tied_output=bool(c.get("tie_word_embeddings", True)),
        attention_scale=float(c.get("query_pre_attn_scalar", 256)) ** -0.5,
        rope_freq_scale=freq_scale, rope_freq_factors=factors,
        embed_scale=float(np.sqrt(np.float32(d), dtype=np.float32)), qk_norm=True, post_norms=True,
        ffn_act="gelu_tanh", sliding_window=int(c["sliding_window"]),
        local_layers=tuple(t == "sliding_attention" for t in types),
        rope_base_local=float(local.get("rope_theta", 10000.0)),
        extra={"general.name": c.get("_name_or_path"), "source": "hf", "qk_rows_stored": "neox",
               "model_type": "gemma3_text"},
    )


def _gpt2_config(c: dict, where: Path) -> Config:
    """GPT2Config -> Config: LayerNorm with biases, learned positions (n_positions of them), fused biased Q|K|V,
    biased output projection and MLP (n_inner, default 4 D) with tanh GELU, tied output; what else would change
    the math is refused by name."""
    act = c.get("activation_function", "gelu_new")
    if act not in GPT2_ACTS:
        raise UnsupportedModelError(f"{where}: activation_function={act!r} is not implemented for gpt2 "
                                    f"(supported: {', '.join(GPT2_ACTS)})")
    for key, ok in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                    ("reorder_and_upcast_attn", False), ("add_cross_attention", False)):
        if c.get(key) is not None and c[key] != ok:
            raise UnsupportedModelError(f"{where}: {key}={c[key]!r} is not implemented for gpt2 (supported: {ok!r})")
    for key in ("vocab_size", "n_embd", "n_layer", "n_head", "n_positions"):
        if c.get(key) is None:
            raise ModelFileError(f"{where}: required key {key!r} is missing")
    d, h = int(c["n_embd"]), int(c["n_head"])
    return Config(
        arch="gpt2", n_vocab=int(c["vocab_size"]), d_model=d, n_layers=int(c["n_layer"]), n_heads=h, n_kv_heads=h,
        head_dim=d // h, d_ff=int(c.get("n_inner") or 4 * d), context_length=int(c["n_positions"]),
        rms_eps=float(np.float32(c.get("layer_norm_epsilon", 1e-5))), rope_base=10000.0, rope_dim=d // h,
        rope_style="neox", tied_output=bool(c.get("tie_word_embeddings", True)), qkv_bias=True,
        norm="layer", pos_embd="learned", ffn_gated=False, ffn_act="gelu_tanh", linear_bias=True,
        extra={"general.name": c.get("_name_or_path"), "source": "hf", "qk_rows_stored": "neox", "model_type": "gpt2"},
    )


def hf_names(cfg, tensors) -> dict:
    """Where an architecture's folder keeps its tensors: the layers' prefix, the embedding, the final norm and
    (GPT-2) the positions and the final norm's bias. GPT-2 files from the hub leave out "transformer."."""
    if cfg.arch == "gpt2":
        p = "transformer." if "transformer.wte.weight" in tensors else ""
        return {"layer": p + "h.", "embed": p + "wte.weight", "norm": p + "ln_f.weight", "norm_b": p + "ln_f.bias",
                "pos": p + "wpe.weight"}
    return {"layer": "model.layers.", "embed": "model.embed_tokens.weight", "norm": "model.norm.weight"}


def gpt2_extra(cfg, names, take) -> dict:
    """GPT-2's model-level tensors beyond the Llama ones: the position table and the final norm's bias."""
    if cfg.arch != "gpt2":
        return {}
    return {"pos_embd": take(names["pos"], (cfg.context_length, cfg.d_model)),
            "out_norm_b": take(names["norm_b"], (cfg.d_model,))}


def from_conv1d(cfg, fields: dict) -> dict:
    """GPT-2's Conv1D matrices [in, out] -> the canonical [out, in]; other architectures' fields as they are."""
    if cfg.arch == "gpt2":
        for k in GPT2_CONV1D:
            if k in fields:
                fields[k] = np.ascontiguousarray(fields[k].T)
    return fields


def rope_fields_from_hf(c: dict, rp: dict, base: float, rope_dim: int, where) -> dict:
    """config.json's RoPE scaling -> the Config's RoPE fields, as transformers' rope init functions read it
    (modeling_rope_utils): default, linear and llama3 (rope_scaling_from_hf); yarn (factor, or
    max_position_embeddings / original; attention_factor, or one from factor, mscale and mscale_all_dim;
    beta_fast, beta_slow, truncate) as a ramp between interpolated and kept pairs and a magnitude; longrope (short_factor, long_factor,
    chosen per step by the sequence's length; attention_factor, or one from factor) and dynamic (NTK, the base
    grown past max_position_embeddings) as step-dependent tables (Cache.tables). Phi3Config reads 'su' and
    'yarn' as longrope. original_max_position_embeddings: config.json's top-level key first (Phi3Config's
    default 4096), as transformers' standardize_rope_params. context_length where a scaling extends it: yarn
    to factor x original, dynamic to factor x max_position_embeddings."""
    kind = rp.get("rope_type") or rp.get("type") or "default"
    phi3 = c.get("model_type") == "phi3"
    if phi3 and kind in ("su", "yarn"):
        kind = "longrope"
    if kind in ("default", "linear", "llama3"):
        freq_scale, factors = rope_scaling_from_hf(rp, base, rope_dim, where)
        return dict(rope_freq_scale=freq_scale, rope_freq_factors=factors)
    if kind not in ("yarn", "longrope", "dynamic"):
        raise UnsupportedModelError(f"{where}: rope scaling {kind!r} is not implemented (supported: default, "
                                    f"linear, llama3, yarn, longrope, dynamic)")
    max_pos = int(c.get("max_position_embeddings", 2048))
    if kind == "dynamic":
        factor = _positive(rp, "factor", where, kind)
        return dict(rope_ntk_factor=factor, rope_orig_ctx=max_pos, context_length=int(max_pos * factor))
    top = c.get("original_max_position_embeddings")
    orig = int(top if top is not None else 4096 if phi3 else rp.get("original_max_position_embeddings", max_pos))
    if orig <= 1:
        raise ModelFileError(f"{where}: {kind} rope scaling: original_max_position_embeddings={orig} must be > 1")
    factor = float(rp["factor"]) if rp.get("factor") is not None else max_pos / orig
    if not factor > 0:
        raise ModelFileError(f"{where}: {kind} rope scaling: factor={factor} must be > 0")
    af = rp.get("attention_factor")
    if kind == "yarn":
        if af is None:
            af = yarn_attn_factor(factor, rp.get("mscale"), rp.get("mscale_all_dim"))
        ramp = yarn_ramp(rope_dim, base, orig, float(rp.get("beta_fast") or 32), float(rp.get("beta_slow") or 1),
                         bool(rp.get("truncate", True)))
        return dict(rope_freq_scale=1.0 / factor, rope_yarn_ramp=ramp, rope_attn_factor=float(af),
                    context_length=max(max_pos, int(factor * orig)))
    sets = []
    for key in ("short_factor", "long_factor"):
        f = rp.get(key)
        if not isinstance(f, list) or len(f) != rope_dim // 2:
            raise ModelFileError(f"{where}: longrope rope scaling needs {key} as a list of {rope_dim // 2} numbers")
        sets.append(tuple(float(x) for x in f))
    if af is None:
        af = longrope_attn_factor(factor, orig)
    return dict(rope_freq_factors=sets[0], rope_freq_factors_long=sets[1], rope_attn_factor=float(af),
                rope_orig_ctx=orig)


def _positive(rp, key, where, kind) -> float:
    try:
        v = float(rp[key])
    except (KeyError, TypeError, ValueError):
        raise ModelFileError(f"{where}: {kind} rope scaling lacks a numeric {key!r}") from None
    if not v > 0:
        raise ModelFileError(f"{where}: {kind} rope scaling: {key}={v} must be > 0")
    return v


def rope_scaling_from_hf(rp: dict, base: float, dim: int, where) -> tuple:
    """Hugging Face rope scaling -> (freq_scale, per-pair frequency factors or None), as llama.cpp's converter
    expresses it: 'linear' divides every angle by the factor; 'llama3' divides low frequencies by the factor,
    keeps high ones and blends in between (factors written to GGUF as rope_freqs.weight)."""
    import math

    kind = rp.get("rope_type") or rp.get("type") or "default"
    if kind == "default":
        return 1.0, None
    if kind == "linear":
        return 1.0 / float(rp["factor"]), None
    if kind != "llama3":
        raise UnsupportedModelError(f"{where}: rope scaling {kind!r} is not implemented here (supported: default, "
                                    f"linear, llama3)")
    try:
        factor, lo, hi = float(rp["factor"]), float(rp["low_freq_factor"]), float(rp["high_freq_factor"])
        old = float(rp["original_max_position_embeddings"])
    except KeyError as e:
        raise ModelFileError(f"{where}: llama3 rope scaling lacks {e.args[0]!r}") from None
    lo_wave, hi_wave = old / lo, old / hi
    out = []
    for i in range(0, dim, 2):
        wavelen = 2 * math.pi * base ** (i / dim)
        if wavelen < hi_wave:
            out.append(1.0)
        elif wavelen > lo_wave:
            out.append(factor)
        else:
            smooth = (old / wavelen - lo) / (hi - lo)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return 1.0, tuple(float(np.float32(f)) for f in out)


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        wm = (_read_json(index) or {}).get("weight_map")
        if not isinstance(wm, dict) or not wm:
            raise ModelFileError(f"{index}: no weight_map")
        files = sorted({folder / f for f in wm.values()})
    else:
        files = [folder / "model.safetensors"]
    for f in files:
        if not f.exists():
            raise ModelFileError(f"{f}: missing (a Hugging Face model folder needs its weights)")
    return files


def read_safetensors(path: Path) -> dict[str, tuple[str, np.ndarray]]:
    """name -> (dtype, float32 array)."""
    return {k: (dt, to_float32(dt, v)) for k, (dt, v) in map_safetensors(path).items()}


def to_float32(dt: str, view) -> np.ndarray:
    """A mapped F32/F16/BF16 view -> a float32 array in memory (bf16 is the top half of a float32)."""
    if dt == "BF16":
        return (np.asarray(view).astype(np.uint32) << 16).view(np.float32)
    return np.ascontiguousarray(view, dtype=np.float32)


def map_safetensors(path: Path) -> dict[str, tuple[str, np.ndarray]]:
    """name -> (dtype, a view of the memory-mapped file, nothing read yet). Parsed from the header directly:
    NumPy has no bfloat16, so the safetensors library cannot hand BF16 tensors to NumPy."""
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    if raw.size < 8:
        raise ModelFileError(f"{path}: truncated safetensors file ({raw.size} bytes)")
    (n,) = struct.unpack("<Q", bytes(raw[:8]))
    if 8 + n > raw.size:
        raise ModelFileError(f"{path}: header length {n} runs past the end of the file ({raw.size} bytes)")
    try:
        header = json.loads(bytes(raw[8:8 + n]).decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelFileError(f"{path}: malformed safetensors header ({e})") from None
    base, out = 8 + n, {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dt, shape, (a, b) = info.get("dtype"), tuple(info.get("shape", ())), info.get("data_offsets", (0, 0))
        if dt not in SAFETENSORS_DTYPES:
            raise UnsupportedModelError(f"{path}: tensor {name!r} has dtype {dt} (supported: F32, F16, BF16)")
        np_dt = np.dtype(SAFETENSORS_DTYPES[dt])
        if b - a != int(np.prod(shape)) * np_dt.itemsize or base + b > raw.size:
            raise ModelFileError(f"{path}: tensor {name!r} byte range {a}..{b} does not fit shape {shape} {dt} "
                                 f"in a {raw.size}-byte file")
        out[name] = (dt, raw[base + a: base + b].view(np_dt).reshape(shape))
    return out


def tokenizer_from_hf(folder: Path):
    from tokenizers import Tokenizer as HFTok

    tj = folder / "tokenizer.json"
    if not tj.exists():
        raise TokenizerError(f"{tj}: missing (llorch-ref builds the tokenizer from tokenizer.json)")
    try:
        hf = HFTok.from_file(str(tj))
    except Exception as e:  # the tokenizers library raises plain Exceptions
        raise TokenizerError(f"{tj}: cannot be loaded ({str(e).splitlines()[0][:200]})") from None
    tc = _read_json(folder / "tokenizer_config.json", required=False) or {}
    gc = _read_json(folder / "generation_config.json", required=False) or {}
    n = hf.get_vocab_size(with_added_tokens=True)
    tokens = [hf.id_to_token(i) or "" for i in range(n)]
    special = {i for i, t in hf.get_added_tokens_decoder().items() if t.special}
    tj_text = hf.to_str()                   # the tokenizer as loaded, to read its pre-tokenizer and normalizer
    kind = "gpt2" if "ByteLevel" in json.dumps(json.loads(tj_text).get("pre_tokenizer")) else "llama"
    byte_piece = lambda t: kind == "llama" and len(t) == 6 and t.startswith("<0x") and t.endswith(">")
    types = [TOKEN_CONTROL if i in special else TOKEN_BYTE if byte_piece(tokens[i]) else TOKEN_NORMAL
             for i in range(n)]

    def tok_id(v):
        if isinstance(v, dict):
            v = v.get("content")
        if v is None:
            return None
        i = hf.token_to_id(v)
        if i is None:
            raise TokenizerError(f"{folder}: special token {v!r} is not in tokenizer.json")
        return i

    bos, eos = tok_id(tc.get("bos_token")), tok_id(tc.get("eos_token"))
    bos = gc.get("bos_token_id", bos) if bos is None else bos
    eos_gen = gc.get("eos_token_id", eos)
    eog = set(eos_gen if isinstance(eos_gen, list) else [eos_gen]) | {eos}
    eos = eos if eos is not None else (sorted(eog - {None}) or [None])[0]
    if "add_bos_token" in tc:
        add_bos = bool(tc["add_bos_token"])
    else:   # a post-processor (Llama 3 style) that prepends BOS says so by doing it
        with_sp = hf.encode("a", add_special_tokens=True).ids
        add_bos = bos is not None and bool(with_sp) and with_sp[0] == bos
    template = tc.get("chat_template")
    if isinstance(template, list):
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    space_prefix = kind == "llama" and ('"Prepend"' in tj_text or '"prepend_scheme":"first"' in tj_text
                                        or '"prepend_scheme":"always"' in tj_text)
    return Tokenizer(hf, kind, tokens, types, bos, eos, add_bos, bool(tc.get("add_eos_token", False)),
                     sorted(i for i in eog if i is not None), template, add_space_prefix=space_prefix)


def _layer_names_and_shapes(cfg) -> tuple[dict, dict]:
    """-> ({HF suffix: our field}, {our field: shape}) of one layer of this architecture."""
    D, F, Hd = cfg.d_model, cfg.d_ff, cfg.head_dim
    shapes = {"attn_norm": (D,), "wq": (cfg.n_heads * Hd, D), "wk": (cfg.n_kv_heads * Hd, D),
              "wv": (cfg.n_kv_heads * Hd, D), "wo": (D, cfg.n_heads * Hd), "ffn_norm": (D,),
              "w_gate": (F, D), "w_up": (F, D), "w_down": (D, F)}
    names = dict(HF_LAYER_TENSORS)
    if cfg.arch == "gpt2":        # stored shapes: Conv1D [in, out], fused Q | K | V with its bias
        n = (cfg.n_heads + 2 * cfg.n_kv_heads) * Hd
        return dict(GPT2_LAYER_TENSORS), {"attn_norm": (D,), "attn_norm_b": (D,), "_qkv": (D, n), "_qkv_b": (n,),
                                          "wo": (cfg.n_heads * Hd, D), "bo": (D,), "ffn_norm": (D,),
                                          "ffn_norm_b": (D,), "w_up": (D, F), "b_up": (F,), "w_down": (F, D),
                                          "b_down": (D,)}
    if cfg.arch == "gemma3":
        names = dict(GEMMA3_LAYER_TENSORS)
        shapes.update({"post_attn_norm": (D,), "post_ffn_norm": (D,), "q_norm": (Hd,), "k_norm": (Hd,)})
    if cfg.arch == "phi3":
        for k in ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                  "mlp.gate_proj.weight", "mlp.up_proj.weight"):
            names.pop(k)
        names.update(HF_FUSED_TENSORS)
        shapes.update({"_qkv": ((cfg.n_heads + 2 * cfg.n_kv_heads) * Hd, D), "_gate_up": (2 * F, D)})
    if cfg.qkv_bias:
        names.update(HF_BIAS_TENSORS)
        shapes.update({"bq": (cfg.n_heads * Hd,), "bk": (cfg.n_kv_heads * Hd,), "bv": (cfg.n_kv_heads * Hd,)})
    return names, shapes


def _canonical_rows(cfg, qk_layout: str, fields: dict) -> dict:
    """One layer's fields as llorch-ref holds them: Gemma norms as multipliers (1 + w), and with qk_layout
    "adjacent" the Q/K rows (and their bias and QK-norm rows) permuted to llama.cpp's adjacent pairs."""
    if cfg.arch == "gemma3":                       # HF Gemma norms compute x / rms * (1 + w)
        for k in GEMMA_NORMS:
            if fields.get(k) is not None:
                fields[k] = (fields[k] + np.float32(1.0)).astype(fields[k].dtype)
    if qk_layout == "adjacent":
        for k, n in (("wq", cfg.n_heads), ("wk", cfg.n_kv_heads)):
            if k in fields:
                fields[k] = permute_qk(fields[k], n)
        for k, n in (("bq", cfg.n_heads), ("bk", cfg.n_kv_heads), ("q_norm", 1), ("k_norm", 1)):
            if fields.get(k) is not None:          # a bias row (a QK-norm weight) travels with its row
                fields[k] = permute_qk(fields[k][:, None], n)[:, 0]
    return fields


def load_hf_folder(folder, qk_layout: str | None = None, lazy: bool = False, weight_cache_mb: float | None = None,
                   weight_dtype: str = "float32") -> HFModel:
    """qk_layout: "adjacent" (Wq/Wk rows permuted to llama.cpp's GGUF layout) or "neox" (rows as stored).
    Default: the layout llama.cpp uses for the architecture (llama: adjacent; qwen2: neox).
    lazy: keep the safetensors files mapped and convert each layer when it runs (as for GGUF files; shapes
    are checked at load, NaN/Inf when a tensor is first read). weight_dtype: storage of 2-D weights."""

    folder = Path(folder)
    c = _read_json(folder / "config.json")
    if qk_layout is None:
        qk_layout = "neox" if c.get("model_type") in ("qwen2", "phi3", "gemma3_text", "gpt2") else "adjacent"
    if qk_layout not in ("adjacent", "neox"):
        raise ParameterError(f"qk_layout {qk_layout!r} must be 'adjacent' or 'neox'")
    store = storage_dtype(weight_dtype)
    if weight_cache_mb is not None and not lazy:
        raise ParameterError("--weight-cache-mb applies to lazy weights only")
    cfg = config_from_hf(c, folder / "config.json", qk_layout)
    tensors: dict[str, tuple[str, np.ndarray]] = {}
    for f in _safetensors_files(folder):
        tensors.update(map_safetensors(f))

    def check(name, shape):
        if name not in tensors:
            raise ModelFileError(f"{folder}: tensor {name!r} is missing")
        if tensors[name][1].shape != shape:
            raise ModelFileError(f"{folder}: tensor {name!r} has shape {tensors[name][1].shape}, expected {shape} "
                                 f"from config.json")

    def take(name, shape, rows=None):
        check(name, shape)
        dt, view = tensors[name]
        arr = to_float32(dt, view if rows is None else view[rows])
        if not np.isfinite(arr).all():
            raise ModelFileError(f"{folder}: tensor {name!r} holds NaN or Inf values")
        return arr.astype(store) if len(shape) == 2 and store != np.float32 else arr

    D = cfg.d_model
    names, shapes = _layer_names_and_shapes(cfg)
    where = hf_names(cfg, tensors)
    pre = where["layer"]

    def permuted(fields):
        return _canonical_rows(cfg, qk_layout, split_fused(cfg, from_conv1d(cfg, fields)))

    def make_layer(i):
        return LayerWeights(**permuted({fld: take(f"{pre}{i}.{sfx}", shapes[fld]) for sfx, fld in names.items()}))

    for i in range(cfg.n_layers):                   # every shape checked at load, lazy or not
        for sfx, fld in names.items():
            check(f"{pre}{i}.{sfx}", shapes[fld])
    if lazy:
        return _lazy_hf(folder, c, cfg, tensors, names, shapes, take, check, make_layer, permuted, store,
                        weight_cache_mb, where)
    layers = [make_layer(i) for i in range(cfg.n_layers)]
    tok_embd = take(where["embed"], (cfg.n_vocab, D))
    if cfg.tied_output:
        output = tok_embd
    else:
        output = take("lm_head.weight", (cfg.n_vocab, D))
    weights = Weights(tok_embd=tok_embd, layers=layers, out_norm=out_norm(cfg, take(where["norm"], (D,))),
                      output=output, **gpt2_extra(cfg, where, take))
    tok = tokenizer_from_hf(folder)
    if tok.n_vocab > cfg.n_vocab:
        raise TokenizerError(f"{folder}: tokenizer has {tok.n_vocab} tokens but the model only {cfg.n_vocab}")
    return HFModel(path=folder, config=cfg, weights=weights, tokenizer=tok, metadata=dict(c),
                   tensor_types={k: v[0] for k, v in tensors.items()})


def out_norm(cfg, w):
    """The final norm's multiplier (Gemma stores w - 1)."""
    return (w + np.float32(1.0)).astype(np.float32) if cfg.arch == "gemma3" else w


def _lazy_hf(folder, c, cfg, tensors, names, shapes, take, check, make_layer, permuted, store, weight_cache_mb,
             where):
    V, D = cfg.n_vocab, cfg.d_model
    check(where["embed"], (V, D))
    out_name = where["embed"] if cfg.tied_output else "lm_head.weight"
    check(out_name, (V, D))
    per_layer = sum(int(np.prod(shapes[f])) * (store.itemsize if len(shapes[f]) == 2 else 4) for f in names.values())
    full = per_layer * cfg.n_layers + V * D * store.itemsize
    cache = WeightCache(default_cache_bytes(full) if weight_cache_mb is None else int(weight_cache_mb * 2**20),
                        asked=weight_cache_mb is not None)
    by_field = {fld: sfx for sfx, fld in names.items()}

    def deq_field(i, fld):
        src = FUSED_OF.get(fld) if FUSED_OF.get(fld) in by_field else fld
        if src not in by_field:
            raise AttributeError(fld)
        fields = {src: take(f"{where['layer']}{i}.{by_field[src]}", shapes[src])}
        return permuted(fields)[fld]          # split_fused leaves unfused fields as they are

    emb = LazyRows(None, (V, D), lambda _t, rows: take(where["embed"], (V, D), rows=rows)
                   .astype(np.float32))
    weights = LazyWeights(emb, LazyLayers(cfg.n_layers, make_layer, deq_field, per_layer, cache),
                          out_norm(cfg, take(where["norm"], (D,))), lambda: take(out_name, (V, D)), V * D * store.itemsize,
                          cache, full, store)
    for k, v in gpt2_extra(cfg, where, take).items():
        setattr(weights, k, v)
    tok = tokenizer_from_hf(folder)
    if tok.n_vocab > cfg.n_vocab:
        raise TokenizerError(f"{folder}: tokenizer has {tok.n_vocab} tokens but the model only {cfg.n_vocab}")
    return HFModel(path=folder, config=cfg, weights=weights, tokenizer=tok, metadata=dict(c),
                   tensor_types={k: v[0] for k, v in tensors.items()})
