"""GGUF -> (Config, Weights, tokenizer metadata): the header by gguf_header, types and dequantization by `gguf`.

ggml order vs NumPy order: a GGUF tensor with ggml shape ne = [ne0, ne1] (ne0 fastest) is the NumPy array
of shape (ne1, ne0). Tensor infos report `.shape` in ggml order (as gguf.GGUFReader); we always store NumPy order.
GGUF llama files hold Wq/Wk rows permuted by llama.cpp's converter so that RoPE rotates adjacent pairs
(2i, 2i+1): Config.rope_style = "adjacent" records that.
"""
from __future__ import annotations

import functools
import struct
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..config import Config
from ..errors import ModelFileError, ParameterError, UnsupportedModelError
from ..model.layers import yarn_attn_factor, yarn_ramp
from ..model.qtensor import QTensor
from ..model.weights import LayerWeights, Weights
from ..numerics import NUMERICS
from ..numerics.ggml_cpu import FloatMatrix, matrix_of
from .gguf_header import GGUFFile, read_gguf
from .lazy_weights import (
    LazyLayers,
    LazyRows,
    LazyWeights,
    WeightCache,
    default_cache_bytes,
    dequantize_rows,
    storage_dtype,
)

GGUF_MAGIC = b"GGUF"
SUPPORTED_ARCHS = ("llama", "qwen2", "phi3", "gemma3", "gpt2")
# qwen2: + QKV biases; phi3: fused qkv and gate|up; gemma3: see gemma3_switches; all three NeoX RoPE;
# gpt2: see gpt2_switches (no RoPE: its Q/K rows stay as stored, as for NeoX)
NEOX_ARCHS = ("qwen2", "phi3", "gemma3", "gpt2")
EPS_KEY = {"gpt2": "attention.layer_norm_epsilon"}     # LayerNorm's; every other: attention.layer_norm_rms_epsilon
GEMMA3_SWA_PERIOD = 6            # llama.cpp's default: layer i is local iff i % 6 < 5
GEMMA3_ROPE_BASE_LOCAL = 10000.0 # llama.cpp's default when gemma3.rope.freq_base_swa is absent


@dataclass
class GGUFModel:
    path: Path
    config: Config
    weights: Weights
    metadata: dict            # every key/value of the file (arrays of strings stay lists)
    tensor_types: dict        # name -> ggml type name (e.g. "Q4_1")
    qtensors: dict = None     # (layer, field) or "output" -> QTensor of every quantized matrix, for backends
                              # and numerics that multiply by the blocks themselves (numba, ggml, cupy)


MIN_KV_BYTES = 8 + 1 + 4            # key length, at least one key byte, value type
MIN_TENSOR_INFO_BYTES = 8 + 1 + 4 + 8 + 4 + 8   # name length, 1 byte, n_dims, one dim, type, offset


def _check_header(path: Path) -> int:
    if not path.exists():
        raise ModelFileError(f"{path}: no such file")
    if path.is_dir():
        raise ModelFileError(f"{path}: is a directory, expected a .gguf file")
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            head = f.read(8)
    except OSError as e:
        raise ModelFileError(f"{path}: cannot read: {e.strerror}") from None
    if len(head) < 8 or head[:4] != GGUF_MAGIC:
        raise ModelFileError(f"{path}: not a GGUF file (magic {head[:4]!r}, expected b'GGUF')")
    version = int.from_bytes(head[4:8], "little")
    if version not in (2, 3):
        raise ModelFileError(f"{path}: unsupported GGUF version {version} (supported: 2, 3)")
    with open(path, "rb") as f:
        f.seek(8)
        counts = f.read(16)
    if len(counts) < 16:
        raise ModelFileError(f"{path}: truncated: the header ends before its tensor and key counts")
    n_tensors, n_kv = int.from_bytes(counts[:8], "little"), int.from_bytes(counts[8:], "little")
    # counts are checked against the file size before anything is allocated or looped over
    if n_kv * MIN_KV_BYTES > size:
        raise ModelFileError(f"{path}: header claims {n_kv} metadata keys, more than a {size}-byte file can hold")
    if n_tensors * MIN_TENSOR_INFO_BYTES > size:
        raise ModelFileError(f"{path}: header claims {n_tensors} tensors, more than a {size}-byte file can hold")
    return size


def open_reader(path) -> GGUFFile:
    """Open a GGUF file (gguf_header.read_gguf), turning its failures into one-line ModelFileErrors."""
    path = Path(path)
    size = _check_header(path)
    try:
        reader = read_gguf(path)
    except (ValueError, IndexError, KeyError, OverflowError, MemoryError, TypeError, struct.error) as e:
        msg = str(e).splitlines()[0][:200] if str(e) else ""
        raise ModelFileError(f"{path}: malformed GGUF header or metadata ({type(e).__name__}: {msg})") from None
    for t in reader.tensors:
        end = int(t.data_offset) + int(t.n_bytes)
        if end > size:
            raise ModelFileError(
                f"{path}: truncated: tensor {t.name!r} ends at byte {end} but the file has {size} bytes")
        if int(t.data_offset) % reader.alignment:
            raise ModelFileError(f"{path}: tensor {t.name!r} data at byte {int(t.data_offset)} is not aligned to "
                                 f"{reader.alignment}")
    return reader


def read_metadata(reader) -> dict:
    """Every key/value of the file (scalars as Python numbers, strings as str, arrays of strings as lists,
    arrays of numbers as NumPy arrays)."""
    return dict(reader.metadata)


def _get(meta, key, default=None, *, required=False, path=""):
    if key in meta:
        return meta[key]
    if required:
        raise ModelFileError(f"{path}: required metadata key {key!r} is missing")
    return default


def config_from_metadata(meta: dict, path, tensor_shapes: dict, rope_freqs=None) -> Config:
    """rope_freqs: the float32 values of the rope_freqs.weight tensor, where the file has one, or (rope_freqs_of)
    a dict of the RoPE factor tensors the file has by name."""
    arch = _get(meta, "general.architecture", required=True, path=path)
    if arch not in SUPPORTED_ARCHS:
        raise UnsupportedModelError(
            f"{path}: architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHS)})")
    a = arch + "."
    d_model = int(_get(meta, a + "embedding_length", required=True, path=path))
    n_heads = int(_get(meta, a + "attention.head_count", required=True, path=path))
    n_kv = int(_get(meta, a + "attention.head_count_kv", n_heads))       # default: MHA
    head_dim = int(_get(meta, a + "attention.key_length", d_model // max(n_heads, 1)))
    emb = tensor_shapes.get("token_embd.weight")
    if emb is None:
        raise ModelFileError(f"{path}: tensor 'token_embd.weight' is missing")
    n_vocab = int(_get(meta, a + "vocab_size", emb[0]))
    if n_vocab != emb[0]:
        raise ModelFileError(f"{path}: {a}vocab_size={n_vocab} but token_embd.weight has {emb[0]} rows")
    n_layers = int(_get(meta, a + "block_count", required=True, path=path))
    rope_dim = int(_get(meta, a + "rope.dimension_count", head_dim))
    tensors = rope_freqs if isinstance(rope_freqs, dict) else {"rope_freqs.weight": rope_freqs}
    rope = rope_fields_from_gguf(meta, a, path, tensor_shapes, tensors, rope_dim,
                                 float(_get(meta, a + "rope.freq_base", 10000.0)),
                                 int(_get(meta, a + "context_length", 2048)))
    return Config(
        arch=arch,
        n_vocab=n_vocab,
        d_model=d_model,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=head_dim,
        d_ff=int(_get(meta, a + "feed_forward_length", required=True, path=path)),
        context_length=int(_get(meta, a + "context_length", 2048)),        # llama.cpp's fallback
        rms_eps=float(np.float32(_get(meta, a + EPS_KEY.get(arch, "attention.layer_norm_rms_epsilon"), 1e-5))),
        rope_base=float(_get(meta, a + "rope.freq_base", 10000.0)),
        rope_dim=rope_dim,
        # llama: LLAMA_ROPE_TYPE_NORM, Wq/Wk rows permuted by llama.cpp's converter; others: NEOX, rows as in HF
        rope_style="neox" if arch in NEOX_ARCHS else "adjacent",
        tied_output="output.weight" not in tensor_shapes,
        **rope,
        qkv_bias="blk.0.attn_q.bias" in tensor_shapes or "blk.0.attn_qkv.bias" in tensor_shapes,
        extra={"general.name": meta.get("general.name"), "file_type": meta.get("general.file_type")},
        **(gemma3_switches(meta, path, d_model, n_heads, head_dim, n_layers) if arch == "gemma3" else {}),
        **(GPT2_SWITCHES if arch == "gpt2" else {}),
    )


# GPT-2, as llama.cpp's gpt2 graph computes it: LayerNorm with biases, learned absolute positions
# (position_embd.weight) added to the embeddings, fused Q|K|V with a bias, biased output projection, an
# ungated MLP up -> GELU (tanh) -> down with biases
GPT2_SWITCHES = dict(norm="layer", pos_embd="learned", ffn_gated=False, ffn_act="gelu_tanh", linear_bias=True)


def gemma3_switches(meta, path, d_model, n_heads, head_dim, n_layers) -> dict:
    """Gemma 3's Config switches, read as llama.cpp reads them (llama_model_gemma3::load_arch_hparams):
    embeddings times sqrtf(D); QK-norm; post-attention and post-FFN norms; GeGLU (tanh GELU); local layers
    every layer but each 6th (or gemma3.attention.sliding_window_pattern), window from
    gemma3.attention.sliding_window, local RoPE base gemma3.rope.freq_base_swa (default 10000, unscaled);
    attention scale 1/sqrt(Hd), except the 27B shape (62 layers): 1/sqrt(D/H). GGUF norm weights already
    hold 1 + w (the converter adds 1), so they are multipliers like every other norm."""
    window = int(_get(meta, "gemma3.attention.sliding_window", 0))
    if window <= 0:
        raise UnsupportedModelError(f"{path}: gemma3 without gemma3.attention.sliding_window is not supported "
                                    f"(llama.cpp then builds a different graph, with final logit soft-capping)")
    pattern = _get(meta, "gemma3.attention.sliding_window_pattern", GEMMA3_SWA_PERIOD)
    if np.ndim(pattern) == 0:
        period = int(pattern)
        if period <= 0:
            raise ModelFileError(f"{path}: gemma3.attention.sliding_window_pattern={period} must be > 0")
        local = tuple(i % period < period - 1 for i in range(n_layers))
    else:
        local = tuple(bool(b) for b in np.asarray(pattern).ravel())
        if len(local) != n_layers:
            raise ModelFileError(f"{path}: gemma3.attention.sliding_window_pattern has {len(local)} entries "
                                 f"for {n_layers} layers")
    return dict(
        embed_scale=float(np.sqrt(np.float32(d_model), dtype=np.float32)),
        qk_norm=True, post_norms=True, ffn_act="gelu_tanh",
        sliding_window=window, local_layers=local,
        rope_base_local=float(_get(meta, "gemma3.rope.freq_base_swa", GEMMA3_ROPE_BASE_LOCAL)),
        attention_scale=float((d_model / n_heads) ** -0.5) if n_layers == 62 else None,
    )


CHUNK_ELEMS = 1 << 22          # rows are dequantized in pieces of about 16 MB of float32 output


def dequantize(t, reader=None) -> np.ndarray:
    """One GGUF tensor -> float32 array in NumPy order. Quantized matrices are dequantized in row chunks on
    all cores (bit-identical to one call: dequantization is per block). With `reader`, the tensor's mapped
    pages are released afterwards (madvise DONTNEED): they leave this process's resident set and stay in
    the page cache, so a later read costs a page-cache hit, not a disk read."""
    shape = tuple(int(n) for n in reversed([int(x) for x in t.shape]))
    kind = t.tensor_type.name
    if kind not in ("F32", "F16") and not hasattr(t.data, "shape"):
        raise ModelFileError(f"tensor {t.name!r}: no data")
    try:
        if kind == "F32":
            arr = np.array(t.data, dtype=np.float32)
        elif kind == "F16":
            arr = np.asarray(t.data).astype(np.float32)
        elif len(shape) == 2 and shape[0] * shape[1] > CHUNK_ELEMS and np.ndim(t.data) == 2:
            arr = _dequantize_rows_parallel(t.data, t.tensor_type, shape)
        else:
            from gguf import quants

            arr = quants.dequantize(t.data, t.tensor_type)
    except NotImplementedError:
        raise UnsupportedModelError(
            f"tensor {t.name!r}: type {t.tensor_type.name} cannot be dequantized by the gguf package") from None
    finally:
        if reader is not None:
            release_pages(reader, t)
    arr = np.ascontiguousarray(arr.reshape(shape), dtype=np.float32)
    if not np.isfinite(arr).all():
        bad = int((~np.isfinite(arr)).sum())
        raise ModelFileError(f"tensor {t.name!r} ({t.tensor_type.name}) holds {bad} NaN or Inf values after "
                             f"dequantization (corrupt weights or scales)")
    return arr


def _dequantize_rows_parallel(data, qtype, shape):
    import os
    from concurrent.futures import ThreadPoolExecutor

    from gguf import quants

    rows, cols = shape
    out = np.empty(shape, dtype=np.float32)
    step = max(1, CHUNK_ELEMS // cols)

    def one(a):
        out[a:a + step] = quants.dequantize(np.asarray(data[a:a + step]), qtype).reshape(-1, cols)

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as ex:
        list(ex.map(one, range(0, rows, step)))
    return out


def release_pages(reader, t):
    """Drop this tensor's pages from the process's mapping (they stay in the page cache)."""
    drop_mapped(reader, t.data)


def drop_mapped(reader, arr):
    """Drop the pages under arr (a view of reader's mapping) from the process (madvise DONTNEED: they leave
    the resident set and stay in the page cache; a later read faults them back in from there)."""
    import mmap

    mm = getattr(reader, "mm", None)
    if mm is None or not hasattr(mm, "madvise") or not hasattr(mmap, "MADV_DONTNEED") or arr.size == 0:
        return
    page = mmap.PAGESIZE
    lo = int(arr.ctypes.data) - int(reader.mapped.ctypes.data)
    hi = lo + int(arr.nbytes) if arr.flags.c_contiguous else \
        int(arr[-1].ctypes.data) - int(reader.mapped.ctypes.data) + int(arr[-1].nbytes)
    start, end = lo // page * page, min(len(mm), -(-hi // page) * page)
    if 0 <= start < end:
        try:
            mm.madvise(mmap.MADV_DONTNEED, start, end - start)
        except (OSError, ValueError):
            pass


def layer_tensors(cfg) -> dict:
    """GGUF name suffix -> (field, shape fn) of one layer: LAYER_TENSORS, the projection biases where the model
    has them, and for phi3 the fused tensors (fields "_qkv", "_gate_up", split by split_fused)."""
    if cfg.arch == "gpt2":
        return dict(GPT2_LAYER_TENSORS)
    t = {**LAYER_TENSORS, **(BIAS_TENSORS if cfg.qkv_bias else {})}
    if cfg.qk_norm:
        t.update(QK_NORM_TENSORS)
    if cfg.post_norms:
        t.update(POST_NORM_TENSORS)
    if cfg.arch == "phi3":
        for k in ("attn_q.weight", "attn_k.weight", "attn_v.weight", "ffn_gate.weight", "ffn_up.weight"):
            t.pop(k)
        t["attn_qkv.weight"] = ("_qkv", lambda c: ((c.n_heads + 2 * c.n_kv_heads) * c.head_dim, c.d_model))
        t["ffn_up.weight"] = ("_gate_up", lambda c: (2 * c.d_ff, c.d_model))
    return t


def split_fused(cfg, fields: dict) -> dict:
    """Phi-3's and GPT-2's fused projections -> the canonical separate ones: qkv rows (and GPT-2's qkv bias) are
    Q | K | V, gate_up rows gate | up. An ungated FFN (GPT-2) has no w_gate."""
    nq, nk = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    for fused, parts in (("_qkv", ("wq", "wk", "wv")), ("_qkv_b", ("bq", "bk", "bv"))):
        if fused in fields:
            qkv = fields.pop(fused)
            for name, lo, hi in zip(parts, (0, nq, nq + nk), (nq, nq + nk, nq + 2 * nk)):
                fields[name] = qkv.rows(lo, hi) if hasattr(qkv, "rows") else np.ascontiguousarray(qkv[lo:hi])
    if not cfg.ffn_gated:
        fields.setdefault("w_gate", None)
    if "_gate_up" in fields:
        gu = fields.pop("_gate_up")
        fields["w_gate"], fields["w_up"] = np.ascontiguousarray(gu[:cfg.d_ff]), np.ascontiguousarray(gu[cfg.d_ff:])
    return fields


def qtensors_of(cfg, reader) -> dict:
    """(layer, field) and "output" -> QTensor of every quantized matrix (not F32/F16), as the file maps it (no
    copy); Phi-3's fused projections split by rows like the weights."""
    by_name = {t.name: t for t in reader.tensors}
    release = functools.partial(drop_mapped, reader)

    def qt(t):
        shape = tuple(int(x) for x in reversed([int(s) for s in t.shape]))
        return QTensor(t.tensor_type.name, shape, t.data, t.name, release)

    out = {}
    for i in range(cfg.n_layers):
        found = {fld: qt(by_name[f"blk.{i}.{suffix}"]) for suffix, (fld, shp) in layer_tensors(cfg).items()
                 if len(shp(cfg)) == 2 and by_name[f"blk.{i}.{suffix}"].tensor_type.name not in ("F32", "F16")}
        for fused, parts in (("_qkv", ("wq", "wk", "wv")), ("_gate_up", ("w_gate", "w_up"))):
            if fused in found:
                q = found.pop(fused)
                sizes = {"wq": cfg.n_heads * cfg.head_dim, "wk": cfg.n_kv_heads * cfg.head_dim,
                         "wv": cfg.n_kv_heads * cfg.head_dim, "w_gate": cfg.d_ff, "w_up": cfg.d_ff}
                lo = 0
                for fld in parts:
                    found[fld] = q.rows(lo, lo + sizes[fld])
                    lo += sizes[fld]
        out.update({(i, fld): q for fld, q in found.items()})
    t = by_name["token_embd.weight" if cfg.tied_output else "output.weight"]
    if t.tensor_type.name not in ("F32", "F16"):
        out["output"] = qt(t)
    return out


FUSED_OF = {"wq": "_qkv", "wk": "_qkv", "wv": "_qkv", "w_gate": "_gate_up", "w_up": "_gate_up",
            "bq": "_qkv_b", "bk": "_qkv_b", "bv": "_qkv_b"}


LAYER_TENSORS = {  # GGUF name suffix -> LayerWeights field, expected NumPy shape (from cfg)
    "attn_norm.weight": ("attn_norm", lambda c: (c.d_model,)),
    "attn_q.weight": ("wq", lambda c: (c.n_heads * c.head_dim, c.d_model)),
    "attn_k.weight": ("wk", lambda c: (c.n_kv_heads * c.head_dim, c.d_model)),
    "attn_v.weight": ("wv", lambda c: (c.n_kv_heads * c.head_dim, c.d_model)),
    "attn_output.weight": ("wo", lambda c: (c.d_model, c.n_heads * c.head_dim)),
    "ffn_norm.weight": ("ffn_norm", lambda c: (c.d_model,)),
    "ffn_gate.weight": ("w_gate", lambda c: (c.d_ff, c.d_model)),
    "ffn_up.weight": ("w_up", lambda c: (c.d_ff, c.d_model)),
    "ffn_down.weight": ("w_down", lambda c: (c.d_model, c.d_ff)),
}
QK_NORM_TENSORS = {
    "attn_q_norm.weight": ("q_norm", lambda c: (c.head_dim,)),
    "attn_k_norm.weight": ("k_norm", lambda c: (c.head_dim,)),
}
POST_NORM_TENSORS = {
    "post_attention_norm.weight": ("post_attn_norm", lambda c: (c.d_model,)),
    "post_ffw_norm.weight": ("post_ffn_norm", lambda c: (c.d_model,)),
}
GPT2_LAYER_TENSORS = {  # llama.cpp's gpt2 tensors: LayerNorm weights and biases, fused qkv, biased matrices
    "attn_norm.weight": ("attn_norm", lambda c: (c.d_model,)),
    "attn_norm.bias": ("attn_norm_b", lambda c: (c.d_model,)),
    "attn_qkv.weight": ("_qkv", lambda c: ((c.n_heads + 2 * c.n_kv_heads) * c.head_dim, c.d_model)),
    "attn_qkv.bias": ("_qkv_b", lambda c: ((c.n_heads + 2 * c.n_kv_heads) * c.head_dim,)),
    "attn_output.weight": ("wo", lambda c: (c.d_model, c.n_heads * c.head_dim)),
    "attn_output.bias": ("bo", lambda c: (c.d_model,)),
    "ffn_norm.weight": ("ffn_norm", lambda c: (c.d_model,)),
    "ffn_norm.bias": ("ffn_norm_b", lambda c: (c.d_model,)),
    "ffn_up.weight": ("w_up", lambda c: (c.d_ff, c.d_model)),
    "ffn_up.bias": ("b_up", lambda c: (c.d_ff,)),
    "ffn_down.weight": ("w_down", lambda c: (c.d_model, c.d_ff)),
    "ffn_down.bias": ("b_down", lambda c: (c.d_model,)),
}
BIAS_TENSORS = {
    "attn_q.bias": ("bq", lambda c: (c.n_heads * c.head_dim,)),
    "attn_k.bias": ("bk", lambda c: (c.n_kv_heads * c.head_dim,)),
    "attn_v.bias": ("bv", lambda c: (c.n_kv_heads * c.head_dim,)),
}


def ggml_matrix(t, shape, lanes=8):
    """numerics="ggml": the weight as ggml blocks whose matmul reproduces llama.cpp's CPU arithmetic (F32 and F16
    products on a build of `lanes` float32 lanes)."""

    name = t.tensor_type.name
    if name in ("F32", "F16"):
        return FloatMatrix(dequantize(t), name, lanes)
    return matrix_of(QTensor(name, tuple(shape), np.asarray(t.data), t.name), what=f"tensor {t.name!r}")


def gpt2_weights(cfg, read) -> dict:
    """The model-level tensors beyond the Llama ones: the learned position table and the final norm's bias
    (GPT-2). read(name, NumPy shape) -> float32 array."""
    out = {}
    if cfg.pos_embd == "learned":
        out["pos_embd"] = read("position_embd.weight", (cfg.context_length, cfg.d_model))
    if cfg.norm == "layer":
        out["out_norm_b"] = read("output_norm.bias", (cfg.d_model,))
    return out


ROPE_FACTOR_TENSORS = ("rope_freqs.weight", "rope_factors_short.weight", "rope_factors_long.weight")


def rope_freqs_of(by_name) -> dict:
    """The RoPE factor tensors of a file (rope_freqs: llama3's; rope_factors_short/long: LongRoPE's) by name,
    as float32 values."""
    return {n: dequantize(by_name[n]) for n in ROPE_FACTOR_TENSORS if n in by_name}


def _rope_factor_tensor(path, name, tensor_shapes, tensors, rope_dim):
    if name not in tensor_shapes:
        return None
    if tensor_shapes[name] != (rope_dim // 2,):
        raise ModelFileError(f"{path}: {name} has shape {tensor_shapes[name]}, expected ({rope_dim // 2},)")
    if tensors.get(name) is None:
        raise ModelFileError(f"{path}: {name} present but not read")
    return tuple(float(x) for x in np.asarray(tensors[name], dtype=np.float32).ravel())


def rope_fields_from_gguf(meta, a, path, tensor_shapes, tensors, rope_dim, base, n_ctx_train) -> dict:
    """GGUF RoPE scaling -> the Config's RoPE fields, as llama.cpp reads it (llama_model::load_hparams,
    llama_context's cparams): {a}rope.scaling.type none | linear | yarn | longrope; factor
    {a}rope.scaling.factor (freq_scale = 1 / factor); {a}rope.scaling.attn_factor multiplies cos and sin
    whatever the type; YaRN over {a}rope.scaling.original_context_length (default: the context length) with
    llama.cpp's defaults ext_factor 1, beta_fast 32, beta_slow 1, its magnitude attn_factor x (1 + 0.1
    ln factor); rope_freqs.weight: llama3's per-pair factors; rope_factors_short/long.weight (phi3): LongRoPE's
    two sets, chosen here by the sequence's length as transformers chooses them (llama.cpp chooses by the
    allocated context per sequence, ggml-org/llama.cpp#24823)."""
    scaling = _get(meta, a + "rope.scaling.type", "none") or "none"
    if scaling not in ("none", "linear", "yarn", "longrope"):
        raise UnsupportedModelError(f"{path}: RoPE scaling {scaling!r} is not implemented (supported: none, "
                                    f"linear, yarn, longrope, and per-pair frequency factors in rope_freqs.weight)")
    for key in ("rope.scaling.yarn_log_multiplier", "rope.scaling.yarn_ext_factor", "rope.scaling.yarn_attn_factor",
                "rope.scaling.yarn_beta_fast", "rope.scaling.yarn_beta_slow"):
        if a + key in meta:        # llama.cpp reads these for a few other architectures only
            raise UnsupportedModelError(f"{path}: {a}{key} is not implemented")
    factor = float(_get(meta, a + "rope.scaling.factor", 1.0) or 1.0)
    if not factor > 0:
        raise ModelFileError(f"{path}: {a}rope.scaling.factor={factor} must be > 0")
    attn = float(_get(meta, a + "rope.scaling.attn_factor", 1.0))
    if not attn > 0:
        raise ModelFileError(f"{path}: {a}rope.scaling.attn_factor={attn} must be > 0")
    orig = int(_get(meta, a + "rope.scaling.original_context_length", 0) or n_ctx_train)
    out = dict(rope_freq_scale=1.0 / factor if scaling in ("linear", "longrope") else 1.0,
               rope_freq_factors=_rope_factor_tensor(path, "rope_freqs.weight", tensor_shapes, tensors, rope_dim),
               rope_attn_factor=attn)
    short, long = (_rope_factor_tensor(path, f"rope_factors_{s}.weight", tensor_shapes, tensors, rope_dim)
                   for s in ("short", "long"))
    if (short is None) != (long is None) or (short is not None and (a != "phi3." or out["rope_freq_factors"])):
        raise UnsupportedModelError(f"{path}: rope_factors_short/long.weight are read as a pair, for phi3 alone "
                                    f"and without rope_freqs.weight")
    if short is not None:
        out.update(rope_freq_factors=short, rope_freq_factors_long=long, rope_orig_ctx=orig)
    if scaling == "yarn":
        if out["rope_freq_factors"] is not None:
            raise UnsupportedModelError(f"{path}: YaRN with per-pair frequency factors is not implemented")
        mscale = np.float32(attn) * np.float32(yarn_attn_factor(factor))        # float32, as ggml's rope_yarn
        out.update(rope_freq_scale=1.0 / factor, rope_yarn_ramp=yarn_ramp(rope_dim, base, orig),
                   rope_attn_factor=float(mscale))
    return out


def load_gguf(path, numerics: str = "exact", lazy: bool = False, weight_cache_mb: float | None = None,
              weight_dtype: str = "float32", lanes: int = 8) -> GGUFModel:
    """GGUF -> Config + Weights. lazy: keep the file mapped and dequantize each layer when it runs, with a
    cache of weight_cache_mb (default: the whole model if it fits in half the available memory).
    weight_dtype: storage of the dequantized 2-D weights (float32, float16, bfloat16); math stays float32.
    lanes: numerics "ggml"'s float32 lanes (ggml_cpu.SIMD_LANES: 8 for an AVX2 build, 16 for AVX-512)."""

    if numerics not in NUMERICS:
        raise ParameterError(f"numerics {numerics!r} must be one of {', '.join(NUMERICS)}")
    if numerics == "ort":
        raise ParameterError("numerics='ort' is ONNX Runtime's arithmetic for MatMulNBits weights: it runs on ONNX "
                             "folders, not GGUF files (to compare an ONNX Runtime dump with this file's weights: --numerics exact)")
    store = storage_dtype(weight_dtype)
    if numerics == "ggml" and (lazy or store != np.float32):
        raise ParameterError("numerics='ggml' multiplies the GGUF blocks themselves: lazy weights and "
                             "--weight-dtype do not apply")
    if weight_cache_mb is not None and not lazy:
        raise ParameterError("--weight-cache-mb applies to lazy weights only")
    if weight_cache_mb is not None and not (weight_cache_mb >= 0):
        raise ParameterError(f"--weight-cache-mb {weight_cache_mb} must be >= 0")
    path = Path(path)
    reader = open_reader(path)
    meta = read_metadata(reader)
    by_name = {t.name: t for t in reader.tensors}
    shapes = {t.name: tuple(int(x) for x in reversed([int(s) for s in t.shape])) for t in reader.tensors}
    cfg = config_from_metadata(meta, path, shapes, rope_freqs_of(by_name))
    fused_q = [t for t in reader.tensors if t.name.endswith(("attn_qkv.weight", "ffn_up.weight"))
               and t.tensor_type.name not in ("F32", "F16")] if cfg.arch in ("phi3", "gpt2") else []
    if numerics == "ggml" and (cfg.arch == "phi3" or fused_q):   # F32/F16 fused rows split (FloatMatrix.rows)
        raise UnsupportedModelError(f"{path}: numerics='ggml' does not split {cfg.arch}'s fused quantized "
                                    f"projections; use numerics='exact'")
    if lazy:
        return _load_lazy(path, reader, meta, by_name, shapes, cfg, weight_cache_mb, store)
    big = path.stat().st_size > (1 << 30)

    def checked(name, shape):
        t = by_name.get(name)
        if t is None:
            raise ModelFileError(f"{path}: tensor {name!r} is missing")
        if shapes[name] != shape:
            raise ModelFileError(f"{path}: tensor {name!r} has shape {shapes[name]} (NumPy order), "
                                 f"expected {shape} from the metadata")
        return t

    def tensor(name, shape, matrix=False):
        t = checked(name, shape)
        if matrix and numerics == "ggml":
            return ggml_matrix(t, shape, lanes)
        try:
            arr = dequantize(t, reader)
        except ModelFileError as e:
            raise ModelFileError(f"{path}: {e}") from None
        except (ValueError, TypeError, IndexError) as e:
            raise ModelFileError(f"{path}: tensor {name!r} cannot be read ({type(e).__name__}: {e})") from None
        if matrix and store != np.float32:
            arr = arr.astype(store)
        return arr

    layers = []
    steps = range(cfg.n_layers)
    if big:                                    # progress on stderr for files over 1 GiB
        from tqdm import tqdm
        steps = tqdm(steps, desc=f"dequantizing {path.name}", unit="layer", file=sys.stderr)
    for i in steps:
        fields = {fld: tensor(f"blk.{i}.{suffix}", shp(cfg), matrix=len(shp(cfg)) == 2)
                  for suffix, (fld, shp) in layer_tensors(cfg).items()}
        layers.append(LayerWeights(**split_fused(cfg, fields)))
    emb = (cfg.n_vocab, cfg.d_model)
    if numerics == "ggml":          # as llama.cpp's get_rows: a lookup dequantizes the rows it reads, nothing at load
        tok = LazyRows(checked("token_embd.weight", emb), emb, dequantize_rows)
    else:
        tok = tensor("token_embd.weight", emb, matrix=cfg.tied_output)
    if cfg.tied_output:
        out = tensor("token_embd.weight", (cfg.n_vocab, cfg.d_model), matrix=True) if numerics == "ggml" else tok
    else:
        out = tensor("output.weight", (cfg.n_vocab, cfg.d_model), matrix=True)
    weights = Weights(tok_embd=tok, layers=layers, out_norm=tensor("output_norm.weight", (cfg.d_model,)),
                      output=out, **gpt2_weights(cfg, tensor))
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    return GGUFModel(path=path, config=cfg, weights=weights, metadata=meta, tensor_types=types,
                     qtensors=qtensors_of(cfg, reader))


def _load_lazy(path, reader, meta, by_name, shapes, cfg, weight_cache_mb, store) -> GGUFModel:
    def check(name, shape):
        if name not in by_name:
            raise ModelFileError(f"{path}: tensor {name!r} is missing")
        if shapes[name] != shape:
            raise ModelFileError(f"{path}: tensor {name!r} has shape {shapes[name]} (NumPy order), "
                                 f"expected {shape} from the metadata")
        return by_name[name]

    def deq(name, matrix):
        try:
            a = dequantize(by_name[name], reader)
        except ModelFileError as e:
            raise ModelFileError(f"{path}: {e}") from None
        except (ValueError, TypeError, IndexError) as e:
            raise ModelFileError(f"{path}: tensor {name!r} cannot be read ({type(e).__name__}: {e})") from None
        return a.astype(store) if matrix and store != np.float32 else a

    full = 0
    for i in range(cfg.n_layers):
        for suffix, (_, shp) in layer_tensors(cfg).items():
            shape = shp(cfg)
            check(f"blk.{i}.{suffix}", shape)
            full += int(np.prod(shape)) * (store.itemsize if len(shape) == 2 else 4)
    full_layers = full
    emb = check("token_embd.weight", (cfg.n_vocab, cfg.d_model))
    out_name = "token_embd.weight" if cfg.tied_output else "output.weight"
    check(out_name, (cfg.n_vocab, cfg.d_model))
    full += cfg.n_vocab * cfg.d_model * store.itemsize
    budget = default_cache_bytes(full) if weight_cache_mb is None else int(weight_cache_mb * 2**20)
    cache = WeightCache(budget, asked=weight_cache_mb is not None)

    def make_layer(i):
        return LayerWeights(**split_fused(cfg, {fld: deq(f"blk.{i}.{suffix}", len(shp(cfg)) == 2)
                                                for suffix, (fld, shp) in layer_tensors(cfg).items()}))

    fields = {fld: (suffix, len(shp(cfg)) == 2) for suffix, (fld, shp) in layer_tensors(cfg).items()}

    def deq_field(i, fld):
        if fld in FUSED_OF and FUSED_OF[fld] in fields:             # phi3: dequantize the fused tensor, split
            suffix, matrix = fields[FUSED_OF[fld]]
            return split_fused(cfg, {FUSED_OF[fld]: deq(f"blk.{i}.{suffix}", matrix)})[fld]
        if fld not in fields:
            raise AttributeError(fld)
        suffix, matrix = fields[fld]
        return deq(f"blk.{i}.{suffix}", matrix)

    per_layer = full_layers // cfg.n_layers

    out_norm = deq(check("output_norm.weight", (cfg.d_model,)).name, False)
    extra = gpt2_weights(cfg, lambda name, shape: deq(check(name, shape).name, False))
    weights = LazyWeights(LazyRows(emb, (cfg.n_vocab, cfg.d_model), dequantize_rows),
                          LazyLayers(cfg.n_layers, make_layer, deq_field, per_layer, cache), out_norm,
                          lambda: deq(out_name, True), cfg.n_vocab * cfg.d_model * store.itemsize, cache, full,
                          store)
    for k, v in extra.items():
        setattr(weights, k, v)
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    return GGUFModel(path=path, config=cfg, weights=weights, metadata=meta, tensor_types=types,
                     qtensors=qtensors_of(cfg, reader))
