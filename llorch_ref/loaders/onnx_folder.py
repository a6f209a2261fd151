"""ONNX Runtime GenAI model folders (genai_config.json, model.onnx, its external data, tokenizer.json), as
onnxruntime-genai's model builder writes them for Llama-family models: the graph's initializers become
llorch-ref's Config and Weights, so the reference can run exactly the weights the engine runs. MatMulNBits
(int4/int8 blocks, scales, optional zero points) and GatherBlockQuantized are dequantized to float32; the
fused QKV projection is split; Q/K rows (Hugging Face's NeoX pairs, as the builder keeps them) are permuted to
llama.cpp's adjacent pairs, as for a Hugging Face folder. The RoPE base comes from the graph's cos/sin cache.

    g = OnnxGraph(folder)            # the proto (no weights loaded), initializers memory-mapped on demand
    g.node(layer, "attn/qkv_proj")   # the builder's node of one projection (MatMul or MatMulNBits)
    load_onnx_folder(folder) -> HFModel
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ..config import Config
from ..errors import ModelFileError, ParameterError, UnsupportedModelError
from ..model.weights import LayerWeights, Weights
from ..numerics.ort_cpu import NBitsMatrix
from .hf_folder import HFModel, tokenizer_from_hf
from .qk_rows import permute_qk

ONNX_DTYPES = {1: np.float32, 2: np.uint8, 3: np.int8, 6: np.int32, 7: np.int64, 10: np.float16}
PROJECTIONS = {"wo": "attn/o_proj", "w_gate": "mlp/gate_proj", "w_up": "mlp/up_proj", "w_down": "mlp/down_proj"}


def is_onnx_folder(path) -> bool:
    p = Path(path)
    return p.is_dir() and (p / "genai_config.json").is_file()


def _onnx():
    try:
        import onnx
    except ImportError:
        raise UnsupportedModelError("an ONNX model folder needs the onnx package: pip install 'llorch-ref[onnx]'") \
            from None
    return onnx


class OnnxGraph:
    """The decoder graph of a GenAI folder: nodes by name, attributes, initializers read from the external data
    file through a memory map (never the whole file in memory)."""

    def __init__(self, folder):
        onnx = _onnx()
        self.folder = Path(folder)
        try:
            self.genai = json.loads((self.folder / "genai_config.json").read_text())
            dec = self.genai["model"]["decoder"]
        except (OSError, ValueError, KeyError) as e:
            raise ModelFileError(f"{self.folder}/genai_config.json: not an onnxruntime-genai config ({e})") from None
        self.decoder = dec
        self.path = self.folder / dec["filename"]
        if not self.path.is_file():
            raise ModelFileError(f"{self.path}: missing (genai_config.json names it)")
        try:
            self.model = onnx.load(str(self.path), load_external_data=False)
        except Exception as e:        # onnx raises DecodeError and friends
            raise ModelFileError(f"{self.path}: not a readable ONNX model ({type(e).__name__}: {e})") from None
        self.nodes = {n.name: n for n in self.model.graph.node}
        self.inits = {t.name: t for t in self.model.graph.initializer}
        self._maps = {}

    def attrs(self, node) -> dict:
        from onnx import helper
        return {a.name: helper.get_attribute_value(a) for a in node.attribute}

    def first(self, op_type):
        n = next((n for n in self.model.graph.node if n.op_type == op_type), None)
        if n is None:
            raise UnsupportedModelError(f"{self.path}: no {op_type} node (not a graph of onnxruntime-genai's builder "
                                        f"for a Llama-family model)")
        return n

    def node(self, layer, what):
        """The node /model/layers.<layer>/<what>/MatMul (or MatMul_Q4, MatMul_Q8: MatMulNBits)."""
        for suffix in ("MatMul", "MatMul_Q4", "MatMul_Q8"):
            n = self.nodes.get(f"/model/layers.{layer}/{what}/{suffix}" if layer is not None else f"/{what}/{suffix}")
            if n is not None:
                return n
        return None

    def array(self, name) -> np.ndarray:
        """An initializer as a NumPy array (external data memory-mapped, read only)."""
        t = self.inits.get(name)
        if t is None:
            raise ModelFileError(f"{self.path}: no initializer {name!r}")
        if t.data_type not in ONNX_DTYPES:
            raise UnsupportedModelError(f"{self.path}: initializer {name!r} has ONNX type {t.data_type}")
        dt = ONNX_DTYPES[t.data_type]
        if t.data_location == 1:                             # EXTERNAL
            info = {e.key: e.value for e in t.external_data}
            f = self.folder / info["location"]
            if f.resolve().parent != self.folder.resolve():
                raise ModelFileError(f"{self.path}: initializer {name!r} points outside the folder ({info['location']})")
            if f not in self._maps:
                self._maps[f] = np.memmap(f, dtype=np.uint8, mode="r")
            off, n = int(info.get("offset", 0)), int(info["length"])
            return self._maps[f][off:off + n].view(dt).reshape(list(t.dims))
        from onnx import numpy_helper
        return numpy_helper.to_array(t)

    def weight(self, node) -> tuple[np.ndarray, str]:
        """A projection's weight as [N out, K in] float32, and its type name (F32, MatMulNBits4, ...)."""
        if node.op_type == "MatMul":
            return np.ascontiguousarray(self.array(node.input[1]).astype(np.float32).T), "F32"
        if node.op_type != "MatMulNBits":
            raise UnsupportedModelError(f"{self.path}: node {node.name} is a {node.op_type}")
        a = self.attrs(node)
        zp = self.array(node.input[3]) if len(node.input) > 3 and node.input[3] else None
        w = dequantize_nbits(self.array(node.input[1]), self.array(node.input[2]), zp, a["bits"], a["block_size"],
                             a["N"], a["K"])
        return w, f"MatMulNBits{a['bits']}"

    def nbits(self, node) -> NBitsMatrix | None:
        """numerics="ort": a MatMulNBits weight as its integers and scales (ONNX Runtime's int8-activation product,
        accuracy_level 4); None for a float MatMul or another accuracy level (float32 math there)."""
        if node.op_type != "MatMulNBits" or self.attrs(node).get("accuracy_level", 0) != 4:
            return None
        a = self.attrs(node)
        zp = self.array(node.input[3]) if len(node.input) > 3 and node.input[3] else None
        q = dequantize_nbits(self.array(node.input[1]), np.ones(a["N"] * (-(-a["K"] // a["block_size"])), np.float32),
                             zp, a["bits"], a["block_size"], a["N"], a["K"])        # unit scales: the integers
        return NBitsMatrix(q, np.asarray(self.array(node.input[2]), np.float32).reshape(a["N"], -1), a["block_size"],
                           f"MatMulNBits{a['bits']}")

    def embedding(self) -> tuple[np.ndarray, str]:
        """The token embedding [V, D]: a Gather of (the transpose of) a float matrix, or a GatherBlockQuantized."""
        n = self.nodes.get("/model/embed_tokens/GatherBlockQuantized")
        if n is not None:
            a = self.attrs(n)
            data = self._source(n.input[0])
            zp = self.array(n.input[3]) if len(n.input) > 3 and n.input[3] else None
            v = data.shape[0]
            blocks = data.reshape(v, -1, a["block_size"] * a["bits"] // 8)
            w = dequantize_nbits(blocks, self.array(n.input[2]), zp, a["bits"], a["block_size"], v,
                                 blocks.shape[1] * a["block_size"])
            return w, f"MatMulNBits{a['bits']}"
        n = self.nodes.get("/model/embed_tokens/Gather")
        if n is None:
            raise UnsupportedModelError(f"{self.path}: no /model/embed_tokens Gather node")
        src = n.input[0]
        producer = next((m for m in self.model.graph.node if src in m.output), None)
        if producer is not None and producer.op_type == "Transpose":
            return np.ascontiguousarray(self.array(producer.input[0]).astype(np.float32).T), "F32"
        return self.array(src).astype(np.float32), "F32"

    def _source(self, name):
        """An initializer, through the Reshape nodes the builder puts in front of it."""
        if name in self.inits:
            return self.array(name)
        producer = next((m for m in self.model.graph.node if name in m.output), None)
        if producer is not None and producer.op_type == "Reshape":
            return self._source(producer.input[0])
        raise UnsupportedModelError(f"{self.path}: cannot trace {name!r} to an initializer")


def dequantize_nbits(b, scales, zero_points, bits, block_size, n, k) -> np.ndarray:
    """MatMulNBits blocks -> float32 [n, k]: b [n, blocks, block_size * bits / 8] uint8 (low bits first), scales
    [n * blocks], zero points packed like b ([n, ceil(blocks * bits / 8)]; default 2^(bits-1))."""
    if bits not in (4, 8):
        raise UnsupportedModelError(f"MatMulNBits with {bits} bits is not implemented (4 and 8 are)")
    b = np.asarray(b, dtype=np.uint8).reshape(n, -1)
    q = (np.stack([b & 0x0F, b >> 4], axis=-1).reshape(n, -1) if bits == 4 else b).astype(np.float32)
    nb = q.shape[1] // block_size
    q = q.reshape(n, nb, block_size)
    s = np.asarray(scales, dtype=np.float32).reshape(n, nb)
    if zero_points is None:
        zp = np.full((n, nb), 2 ** (bits - 1), dtype=np.float32)
    else:
        z = np.asarray(zero_points, dtype=np.uint8).reshape(n, -1)
        zp = (np.stack([z & 0x0F, z >> 4], axis=-1).reshape(n, -1) if bits == 4 else z)[:, :nb].astype(np.float32)
    w = (q - zp[:, :, None]) * s[:, :, None]
    return np.ascontiguousarray(w.reshape(n, nb * block_size)[:, :k], dtype=np.float32)


def rope_base_of(cos, sin, rope_dim: int, where) -> float:
    """The RoPE base from the graph's cos/sin cache [P, R/2] (its row 1 holds the angles theta_i); checked
    against every entry of the cache as llorch-ref would build it."""
    theta = np.arctan2(sin[1].astype(np.float64), cos[1].astype(np.float64))     # theta_i = base^(-2i/R)
    i = np.arange(1, len(theta))
    est = np.exp(np.median(-np.log(theta[1:]) * rope_dim / (2.0 * i))) if len(theta) > 1 else 10000.0
    base = float(f"{est:.5g}")                  # bases are round numbers (1e4, 1e5, 5e5); the cache is float32
    inv = base ** (-np.arange(0, rope_dim, 2, dtype=np.float64) / rope_dim)
    ang = np.arange(cos.shape[0], dtype=np.float64)[:, None] * inv[None, :]
    err = max(np.abs(np.cos(ang) - cos).max(), np.abs(np.sin(ang) - sin).max())
    if err > 1e-3:
        raise UnsupportedModelError(f"{where}: the graph's RoPE cache is not plain RoPE with base {base:g} (max "
                                    f"difference {err:.3g}; scaled RoPE from ONNX graphs is not implemented)")
    return base


def load_onnx_folder(folder, numerics: str = "exact") -> HFModel:
    """numerics "exact": every weight float32 (MatMulNBits blocks dequantized); "ort": MatMulNBits weights of
    accuracy level 4 kept as integers and scales, multiplied as ONNX Runtime does (int8 activations)."""
    if numerics not in ("exact", "ort"):
        raise ParameterError(f"numerics {numerics!r}: an ONNX folder runs 'exact' or 'ort'")
    g = OnnxGraph(folder)
    m, dec = g.genai["model"], g.decoder
    if m.get("type") != "llama":
        raise UnsupportedModelError(f"{g.folder}: model type {m.get('type')!r}; ONNX folders of type 'llama' are "
                                    f"supported")
    gqa, ln = g.attrs(g.first("GroupQueryAttention")), g.attrs(g.first("SimplifiedLayerNormalization"))
    if gqa.get("rotary_interleaved", 0) or not gqa.get("do_rotary", 1) or gqa.get("local_window_size", -1) != -1:
        raise UnsupportedModelError(f"{g.folder}: GroupQueryAttention with interleaved or no rotary, or a local "
                                    f"window, is not implemented")
    n_layers, hd = int(dec["num_hidden_layers"]), int(dec["head_size"])
    h, kv = int(dec["num_attention_heads"]), int(dec["num_key_value_heads"])
    cos, sin = g.array("cos_cache"), g.array("sin_cache")
    types, layers = {}, []
    for i in range(n_layers):
        f = _layer(g, i, h, kv, hd, types, numerics == "ort")
        for k, n in (("wq", h), ("wk", kv)):                # NeoX rows -> adjacent pairs (as a HF llama folder)
            f[k] = f[k].rows(_adjacent(f[k].shape[0], n)) if isinstance(f[k], NBitsMatrix) else permute_qk(f[k], n)
        layers.append(LayerWeights(**f))
    tok_embd, types["token_embd.weight"] = g.embedding()
    head = g.node(None, "lm_head")
    output, types["output.weight"] = g.weight(head) if head is not None else (tok_embd, types["token_embd.weight"])
    tied = head is None or np.array_equal(output, tok_embd)
    if head is not None and numerics == "ort" and g.nbits(head) is not None:
        output = g.nbits(head)
    final = g.nodes.get(f"/model/layers.{n_layers}/final_norm_layernorm/SkipLayerNorm")
    if final is None:
        raise UnsupportedModelError(f"{g.folder}: no final norm node /model/layers.{n_layers}/final_norm_layernorm")
    scale = float(gqa.get("scale", 0.0)) or None
    cfg = Config(arch="llama", n_vocab=int(m["vocab_size"]), d_model=int(dec["hidden_size"]), n_layers=n_layers,
                 n_heads=h, n_kv_heads=kv, head_dim=hd, d_ff=layers[0].w_gate.shape[0],
                 context_length=int(m.get("context_length", cos.shape[0])), rms_eps=float(ln["epsilon"]),
                 rope_base=rope_base_of(cos, sin, 2 * cos.shape[1], g.folder), rope_dim=2 * cos.shape[1],
                 rope_style="adjacent", tied_output=tied and not isinstance(output, NBitsMatrix),
                 attention_scale=None if scale is None or abs(scale - hd ** -0.5) < 1e-7 else scale,
                 extra={"source": "onnx", "qk_rows_stored": "neox", "general.name": g.folder.name})
    weights = Weights(tok_embd=tok_embd, layers=layers, out_norm=_norm(g, final), output=output)
    return HFModel(path=g.folder, config=cfg, weights=weights, tokenizer=tokenizer_from_hf(g.folder),
                   metadata={"genai_config": g.genai}, tensor_types=types)


def _norm(g, node) -> np.ndarray:
    """A (Skip)SimplifiedLayerNormalization's weight (input 1, or 2 after the skip input)."""
    return g.array(node.input[1 if node.op_type == "SimplifiedLayerNormalization" else 2]).astype(np.float32)


def _adjacent(rows: int, n_heads: int) -> np.ndarray:
    """The row permutation NeoX -> adjacent pairs (permute_qk on row indices)."""
    return permute_qk(np.arange(rows, dtype=np.float64)[:, None], n_heads)[:, 0].astype(np.int64)


def _proj(g, node, ort: bool):
    """A projection's weight: float32 [N, K], or (numerics ort) its NBitsMatrix; and its type name."""
    w, t = g.weight(node)
    m = g.nbits(node) if ort else None
    return (w if m is None else m), t


def _layer(g, i, h, kv, hd, types, ort=False) -> dict:
    pre = f"/model/layers.{i}"
    attn = g.nodes.get(f"{pre}/input_layernorm/LayerNorm") or g.nodes.get(f"{pre}/input_layernorm/SkipLayerNorm")
    ffn = g.nodes.get(f"{pre}/post_attention_layernorm/SkipLayerNorm")
    if attn is None or ffn is None:
        raise UnsupportedModelError(f"{g.folder}: layer {i}: no input_layernorm / post_attention_layernorm node")
    f = {"attn_norm": _norm(g, attn), "ffn_norm": _norm(g, ffn)}
    qkv = g.node(i, "attn/qkv_proj")
    if qkv is not None:
        w, t = _proj(g, qkv, ort)
        cut = lambda a, b: w.rows(slice(a, b)) if isinstance(w, NBitsMatrix) else np.ascontiguousarray(w[a:b])
        f["wq"], f["wk"], f["wv"] = (cut(a, b) for a, b in
                                     ((0, h * hd), (h * hd, (h + kv) * hd), ((h + kv) * hd, (h + 2 * kv) * hd)))
        types.update({f"blk.{i}.attn_{x}.weight": t for x in "qkv"})
    else:
        for fld, what in (("wq", "attn/q_proj"), ("wk", "attn/k_proj"), ("wv", "attn/v_proj")):
            n = g.node(i, what)
            if n is None:
                raise UnsupportedModelError(f"{g.folder}: layer {i}: no {what} node")
            f[fld], types[f"blk.{i}.{fld}.weight"] = _proj(g, n, ort)
    for fld, what in PROJECTIONS.items():
        n = g.node(i, what)
        if n is None:
            raise UnsupportedModelError(f"{g.folder}: layer {i}: no {what} node")
        f[fld], types[f"blk.{i}.{fld}.weight"] = _proj(g, n, ort)
    return f
