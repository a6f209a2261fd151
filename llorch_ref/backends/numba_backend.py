"""The Numba backend: NumPy arrays, with matrix products computed from the quantized GGUF blocks by Numba
kernels for one-token steps and for several tokens when the float32 weights are not at hand (lazy weights the
cache does not keep: by default none where the kernels serve every matrix; otherwise those go to BLAS, split over
the backend's threads by cpu_split with BLAS itself on one thread), and Numba RMSNorm, RoPE, SwiGLU and attention
for one-token steps."""
from __future__ import annotations

import itertools
import os
import re
import time
from collections import Counter
from dataclasses import replace

import numpy as np

from ..model.attention_chunks import attention_in_chunks
from ..numerics.ggml_cpu import ACT_TYPE, FloatMatrix, KQuantMatrix, LegacyQuantMatrix
from . import Backend, cpu_threads, l2_bytes, limit_blas
from . import numba_ggml as G
from . import numba_kernels as K
from . import numba_simd as S
from .cpu_split import SPLIT, blas_controller, spare_cores
from .fused_forward import Fusions
from .fused_forward import forward as fused_forward
from .settings import settings

KERNEL_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "Q2_K", "Q3_K")
PATHS: Counter = Counter()        # (weight type, path, rows) -> products: what `bench` reports
SPIN_COUNT = None                 # GOMP_SPINCOUNT as the first NumbaBackend left it for numba's OpenMP threads
MATRIX_FIELDS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


def row_addresses(qts):
    """QTensors (rows C-contiguous) -> int64 [sum N_i]: where each row's blocks start in memory, in order."""
    return np.concatenate([q.blocks.ctypes.data + np.arange(q.shape[0], dtype=np.int64) * q.blocks.strides[0]
                           for q in qts]).astype(np.int64)


def tokens_per_chunk(k: int) -> int:
    """Tokens whose float32 activations of width k fill 3/4 of a core's L2 cache, in the kernels' fours."""
    return max(4, int(0.75 * l2_bytes()) // (4 * k) // 4 * 4)


class KernelBlocks:
    """One or several QTensors of one type and input size, stacked by rows ([sum N_i, K]: one kernel launch
    computes them all, each row exactly as its own matrix would), read where they lie: the kernel
    (numba_kernels.matmul_rows_for the type, numba_simd's vector loops) takes the address of every row's blocks in the
    mapped file, so nothing is copied, unpacked or laid out at load, and the weights' memory is the file's
    pages. The QTensors are kept: their arrays keep the mapping alive."""

    def __init__(self, qts):
        self.qtype, self.k = qts[0].qtype, qts[0].shape[1]
        if self.qtype not in S.TYPE_CODE:
            raise ValueError(f"no numba kernel for {self.qtype}")
        self.qts = [q if q.blocks.strides[1] == 1 else replace(q, blocks=np.ascontiguousarray(q.blocks)) for q in qts]
        self.n = sum(q.shape[0] for q in qts)
        self.code, self.n_blocks = S.TYPE_CODE[self.qtype], self.k // S.BLOCKS[self.qtype][0]
        self.kernel = K.matmul_rows_for(self.code)
        self.kind = "in place"
        self.rows = row_addresses(self.qts)

    def nbytes(self) -> int:
        return sum(q.blocks.nbytes for q in self.qts)

    def matmul(self, x):
        """x: [T, K] f32 -> [T, N] f32; every row exactly as matvec computes it alone. The tokens go in chunks
        whose activations fit in a core's L2 cache (each pair of weight rows streams a chunk's activations past
        it): 1.07-1.11x on 7B-width matrices at 64 and 256 tokens, the same products."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        out = np.empty((x.shape[0], self.n), dtype=np.float32)
        step = tokens_per_chunk(self.k)
        for t in range(0, x.shape[0], step):
            self.kernel(self.rows, self.n_blocks, x[t:t + step], out[t:t + step])
        return out

    def matvec(self, x):
        """x: [K] f32 -> [N] f32."""
        return self.matmul(x[None, :])[0]


class KernelMatrix:
    """A weight [N, K] as the numba backend holds it: rows lo..hi of KernelBlocks (a stacked group's member,
    or the whole of its own), and the float32 weight for several-token products when it is at hand (eager
    weights, or lazy ones the cache keeps or will keep): dense_ready() says so, dense() gets it."""

    dtype = np.dtype(np.float32)

    def __init__(self, blocks, lo, hi, dense, dense_ready):
        self.blocks, self.lo, self.hi, self._dense, self._ready = blocks, lo, hi, dense, dense_ready

    @property
    def shape(self):
        return (self.hi - self.lo, self.blocks.k)

    def dense_ready(self) -> bool:
        return self._ready()

    def matmul(self, x):
        """x: [T, K] f32 -> [T, N] f32: the kernel for one row, and for several when the float32 weight would
        have to be dequantized first (lazy weights not cached); BLAS on the float32 weight otherwise."""
        rows = "1 row" if x.shape[0] == 1 else "several rows"
        if x.shape[0] == 1 or not self.dense_ready():
            PATHS[(self.blocks.qtype, f"numba kernel ({self.blocks.kind})", rows)] += 1
            return self.blocks.matmul(x)[:, self.lo:self.hi]
        PATHS[(self.blocks.qtype, "BLAS on the float32 weight", rows)] += 1
        return SPLIT.product(x, self._dense())


class NumbaLayers:
    """The model's layers with KernelMatrix handles in place of the kernel-served matrices; every other
    field (norms, biases, matrices of other types) is read from the weights underneath, eager or lazy."""

    def __init__(self, layers, handles):
        self._handles = handles
        self._views = [_NumbaLayer(layers, i, h) for i, h in enumerate(handles)]

    def __len__(self):
        return len(self._views)

    def __getitem__(self, i):
        return self._views[i]

    def __iter__(self):
        return iter(self._views)


class _NumbaLayer:
    """One layer's fields. Handles and 1-D fields (norms, biases: small) are kept after their first use,
    so a decode step reads plain attributes; other matrices are fetched from the weights each time."""

    def __init__(self, layers, i, handles):
        self._layers, self._i, self._handles = layers, i, handles

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        h = self._handles.get(name)
        if h is not None:
            layers, i = self._layers, self._i
            keeps = getattr(layers, "keeps", None)                  # lazy layers; eager ones are always at hand
            value = KernelMatrix(*h, lambda: getattr(layers[i], name), (lambda: keeps(i)) if keeps else (lambda: True))
        else:
            value = getattr(self._layers[self._i], name)
            if getattr(value, "ndim", 2) != 1:
                return value
        self.__dict__[name] = value
        return value


class NumbaWeights:
    """Weights as the numba backend sees them: same attributes as model.weights.Weights."""

    def __init__(self, weights, handles, output):
        self._w = weights
        self.tok_embd, self.out_norm = weights.tok_embd, weights.out_norm
        self.pos_embd, self.out_norm_b = weights.pos_embd, weights.out_norm_b        # GPT-2's (else None)
        self.layers = NumbaLayers(weights.layers, handles)
        self._output = output
        self.lazy = getattr(weights, "lazy", False)
        if output is not None:
            ready = weights.keeps_output if self.lazy else (lambda: True)
            self._handle = KernelMatrix(*output, lambda: weights.output, ready)

    @property
    def output(self):
        return self._w.output if self._output is None else self._handle

    def info(self) -> dict:
        return {**self._w.info(), "kernel_blocks_mb": round(self.blocks_bytes() / 2**20, 1)}

    def blocks_bytes(self) -> int:
        seen = {id(h[0]): h[0] for layer in self.layers._handles for h in layer.values()}
        if self._output is not None:
            seen[id(self._output[0])] = self._output[0]
        return sum(q.nbytes() for q in seen.values())


GROUPS = (("wq", "wk", "wv"), ("wo",), ("w_gate", "w_up"), ("w_down",))   # a layer's products, by their input


def stacked_paths(engine, kernel) -> Counter:
    """What `bench` reports of a fused step's products: for every layer and group, each run of consecutive
    matrices of one type (the fused step's kernel calls: numba_kernels.run_end's runs)."""
    kinds = Counter()
    for lw in engine.weights.layers:
        for group in GROUPS:
            for qtype, run in itertools.groupby(qtype_of(getattr(lw, f)) for f in group):
                n = len(list(run))
                kinds[(qtype, f"{kernel}{f', {n} matrices stacked' if n > 1 else ''}, fused layer step", "1 row")] += 1
    return kinds


def qtype_of(m) -> str:
    return m.blocks.qtype if isinstance(m, KernelMatrix) else m.qtype


def stack_members(engine, member):
    """The layers' matrices as a fused step takes them -> dict(codes, n_blocks [L, 7], rows [L, N], shapes (nq, nk,
    nf)), or None where a matrix has no kernel (member(matrix): (type code, blocks a row, int64 row addresses), or
    None) or the layers differ in shape (their rows are stacked by layer)."""
    got, shapes = [], set()
    for lw in engine.weights.layers:
        ms = [getattr(lw, f) for f in MATRIX_FIELDS]
        got.append([member(m) for m in ms])
        if any(g is None for g in got[-1]) or any(len({getattr(lw, f).shape[1] for f in g}) != 1 for g in GROUPS):
            return None
        shapes.add(tuple(m.shape for m in ms))
    if len(shapes) != 1:
        return None
    (q, k, v, _o, g, _u, _d), = shapes
    return dict(codes=np.array([[c for c, _, _ in ly] for ly in got], np.int64),
                n_blocks=np.array([[n for _, n, _ in ly] for ly in got], np.int64),
                rows=np.stack([np.concatenate([r for _, _, r in ly]) for ly in got]).astype(np.int64),
                shapes=(q[0], k[0], g[0]))


class _OneCallStep:
    """decode(token) -> logits [1, V]: the embedding, every layer in one numba call (a subclass's _layers), then
    the final norm and output product by the engine's ops. plan(engine, cache) (a subclass's): the layers'
    arguments stacked ([L, ...] arrays), or None where a model needs anything the call does not do (then
    make_decoder keeps the op-by-op step)."""

    def __init__(self, engine, cache, plan):
        self.engine, self.cache, self.plan_args = engine, cache, plan
        self.kv_head = engine.ops.kv_head_of(np, engine.config.n_heads, engine.config.n_kv_heads)

    def __call__(self, token):
        eng, c = self.engine, self.cache
        cfg, w = eng.config, eng.weights
        eng.backend.before_step()
        c.check_room(1)
        x = w.tok_embd[np.asarray([token])].astype(np.float32, copy=False)
        if cfg.embed_scale is not None:
            x = x * np.float32(cfg.embed_scale)
        cos, sin = c.rope_rows(1)
        x = self._layers(x, np.ascontiguousarray(cos[0]), np.ascontiguousarray(sin[0]))
        c.advance(1)
        PATHS.update(self.paths)
        x = eng.ops.rms_norm(np, x.reshape(1, -1), w.out_norm, cfg.rms_eps)
        return eng.ops.linear(np, x, w.output)


class FusedDecoder(_OneCallStep):
    """Exact numerics: decode_step (each layer by decode_layer) with the kernels and arguments of the op-by-op path
    (the same logits to the bit: tests/test_backends.py), so that a decode step pays Python once instead of once
    per operation. Q/K/V, gate/up: each run of one type stacked (llama.cpp's Q4_K_M files mix Q4_K, Q6_K, Q5_0 and
    Q8_0 among them)."""

    def __init__(self, engine, cache, plan):
        super().__init__(engine, cache, plan)
        self.paths = stacked_paths(engine, "numba kernel (in place)")
        codes = plan["codes"]
        self.step = K.decode_step_for(codes.flat[0] if (codes == codes.flat[0]).all() else -1)

    @staticmethod
    def plan(engine, cache):
        cfg, w, be = engine.config, engine.weights, engine.backend
        if not isinstance(w, NumbaWeights) or not be.all_kernels or cache.kv_dtype != np.float32 or cfg.qkv_bias \
                or cfg.qk_norm or cfg.post_norms or cfg.ffn_act != "silu" or cfg.sliding_window \
                or cfg.rope_base_local is not None or cfg.rope_style not in ("adjacent", "neox"):
            return None
        member = lambda m: (m.blocks.code, m.blocks.n_blocks, m.blocks.rows[m.lo:m.hi]) \
            if isinstance(m, KernelMatrix) else None                            # noqa: E731
        plan = stack_members(engine, member)
        if plan is None:
            return None
        stack = lambda f: np.ascontiguousarray(np.stack([f(lw) for lw in w.layers]), dtype=np.float32)  # noqa: E731
        return dict(plan, attn_norms=stack(lambda lw: lw.attn_norm), ffn_norms=stack(lambda lw: lw.ffn_norm))

    def _layers(self, x, cos, sin):
        eng, c, p, cfg = self.engine, self.cache, self.plan_args, self.engine.config
        return self.step(x, p["attn_norms"], p["ffn_norms"], cfg.rms_eps, p["codes"], p["n_blocks"], p["rows"],
                         *p["shapes"], cos, sin, cfg.rope_style == "neox", c.k, c.v, c.pos, cfg.scale, self.kv_head,
                         eng.backend.all_kernels)


class GgmlFusedDecoder(_OneCallStep):
    """numerics="ggml": numba_ggml.decode_step, ggml's arithmetic bit for bit as the op-by-op step with ggml_cpu's
    ops computes it (tests/test_ggml_numerics.py checks both against llama.cpp), on a float32 or float16 K/V cache.
    plan() gives None for what decode_step does not do: biases, QK-norm, Gemma's extras, matrices without a ggml
    kernel."""

    def __init__(self, engine, cache, plan):
        super().__init__(engine, cache, plan)
        self.step = G.decode_step16 if engine.ops.lanes == 16 else G.decode_step8      # the build's lanes
        self.paths = stacked_paths(engine, "numba ggml kernel (in place)")

    @staticmethod
    def plan(engine, cache):
        cfg, w = engine.config, engine.weights
        if cache.kv_dtype not in (np.float32, np.float16) or cfg.qkv_bias or cfg.qk_norm or cfg.post_norms \
                or cfg.ffn_act != "silu" or cfg.sliding_window or cfg.rope_base_local is not None \
                or cfg.rope_style not in ("adjacent", "neox"):
            return None
        member = lambda m: (S.TYPE_CODE[m.qtype], m.shape[1] // m.block, m.rows) \
            if isinstance(m, _GgmlMatrix) else None                             # noqa: E731
        plan = stack_members(engine, member)
        if plan is None:
            return None
        return dict(plan, attn_norms=np.stack([np.asarray(lw.attn_norm, np.float32) for lw in w.layers]),
                    ffn_norms=np.stack([np.asarray(lw.ffn_norm, np.float32) for lw in w.layers]))

    def _layers(self, x, cos, sin):
        c, p, cfg = self.cache, self.plan_args, self.engine.config
        kc, vc = (c.k, c.v) if c.k.dtype == np.float32 else (c.k.view(np.uint16), c.v.view(np.uint16))   # f16 bits
        return self.step(np.ascontiguousarray(x[0]), p["attn_norms"], p["ffn_norms"], cfg.rms_eps, p["codes"],
                         p["n_blocks"], p["rows"], *p["shapes"], cos, sin, cfg.rope_style == "neox", kc, vc,
                         c.pos, cfg.scale, self.kv_head)


class _GgmlMatrix:
    """numerics="ggml": a quantized weight whose product a numba kernel computes on its QTensor's blocks where they
    lie, bit for bit the NumPy emulation's (numerics.ggml_cpu), and so llama.cpp's: matmul counts the path, makes x a
    contiguous float32 [T, K] and hands it to _product (a subclass's) -> [T, N]."""

    block = 32                         # elements a block (K-quants: 256)

    def __init__(self, qt):
        self.qtype, self.shape = qt.qtype, tuple(qt.shape)
        self.qt = qt if qt.blocks.strides[1] == 1 else replace(qt, blocks=np.ascontiguousarray(qt.blocks))
        self.rows = row_addresses([self.qt])            # where each row's blocks start: the kernels read them there

    @property
    def dtype(self):
        return np.dtype(np.float32)

    def matmul(self, x):
        PATHS[(self.qtype, "numba ggml kernel (in place)", "1 row" if x.shape[0] == 1 else "several rows")] += 1
        x = np.ascontiguousarray(x, dtype=np.float32)
        out = np.empty((x.shape[0], self.shape[0]), np.float32)
        self._product(x, out)
        return out


class GgmlKernelMatrix(_GgmlMatrix):
    """A Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 weight: Q8 activations (numba_ggml.quantize_rows), then numba_kernels.ggml_rows
    (numerics.ggml_cpu.LegacyQuantMatrix's bits)."""

    def __init__(self, qt):
        super().__init__(qt)
        self.with_sum = ACT_TYPE[qt.qtype] == "Q8_1"

    def _product(self, x, out):
        t, k = x.shape
        qa, da, sa = np.empty((t, k), np.int8), np.empty((t, k // 32), np.float32), np.empty((t, k // 32), np.float32)
        G.quantize_rows(x, qa, da, sa)              # ggml_cpu.quantize_q8's bits (sa: Q8_1's sums, unread for Q8_0)
        K.ggml_rows(S.TYPE_CODE[self.qtype], self.rows, k // 32, qa, da, sa, out)


class GgmlKQuantMatrix(_GgmlMatrix):
    """A Q2_K..Q6_K weight: Q8_K activations (numba_ggml.quantize_q8k_rows), then numba_ggml.kquant_rows
    (numerics.ggml_cpu.KQuantMatrix's bits), without the emulation's unpacked copy (4x the blocks)."""

    block = 256

    def _product(self, x, out):
        t, k = x.shape
        qa, da = np.empty((t, k), np.int8), np.empty((t, k // 256), np.float32)
        bsums = np.empty((t, k // 256, 16), np.int32)
        G.quantize_q8k_rows(x, qa, da, bsums)
        G.kquant_rows(S.TYPE_CODE[self.qtype], self.rows, qa, da, bsums, out)


class NumbaOps:
    """numerics "exact"'s layer functions on the numba backend: model.layers' (base) with the numba kernels where
    they serve. Matrix products: KernelMatrix handles by their kernels (see KernelMatrix.matmul), stacked groups in
    one call, other float matrices by BLAS split over the threads (cpu_split). One-token steps: RMSNorm, RoPE,
    SwiGLU's silu(gate) * up and attention by the kernels. Several rows: RMSNorm and RoPE by the kernels (serial;
    RoPE the same to the bit), the rest as the reference computes it (numpy, BLAS), whose threads would otherwise
    compete with numba's. Every other public name of base is base's own."""

    def __init__(self, base, backend):
        own = set(dir(type(self)))
        self.__dict__.update({n: getattr(base, n) for n in dir(base) if not n.startswith("_") and n not in own})
        self._base, self._backend = base, backend
        self.fusions = Fusions(attention_out=self.attention_out)

    def linear(self, xp, x, w):
        if isinstance(w, KernelMatrix):
            return w.matmul(x)
        PATHS[(str(getattr(w, "dtype", "?")), "NumPy/BLAS (no kernel for this type)",
               "1 row" if x.shape[0] == 1 else "several rows")] += 1
        if x.shape[0] != 1 and isinstance(w, np.ndarray):
            return SPLIT.product(x, w if w.dtype == np.float32 else w.astype(np.float32))
        return self._base.linear(xp, x, w)

    def _stacked(self, x, *ws):
        """-> the outputs of a stacked group, one [T, N_i] array per weight, from one kernel call (for one row, or
        for several when the kernel serves them: see KernelMatrix.matmul), or None."""
        if not all(isinstance(w, KernelMatrix) for w in ws) or not all(w.blocks is ws[0].blocks for w in ws) \
                or ws[-1].hi != ws[0].blocks.n or (x.shape[0] != 1 and ws[0].dense_ready()):
            return None
        y = ws[0].blocks.matmul(x)
        rows = "1 row" if x.shape[0] == 1 else "several rows"
        PATHS[(ws[0].blocks.qtype, f"numba kernel ({ws[0].blocks.kind}), {len(ws)} matrices stacked", rows)] += 1
        return [y[:, w.lo:w.hi] for w in ws]

    def _products(self, xp, x, *ws):
        """x times each of ws: one stacked kernel call where _stacked takes them, else one product each."""
        return self._stacked(x, *ws) or [self.linear(xp, x, w) for w in ws]

    def rms_norm(self, xp, x, w, eps):
        rows = np.ascontiguousarray(x).reshape(-1, x.shape[-1])          # [T, D], or [T, heads, Hd] (QK-norm)
        out = np.empty_like(rows)
        K.rms_norm_rows(rows, w, eps, out)
        return out.reshape(x.shape)

    def qkv(self, xp, x, wq, wk, wv, h, kv, hd):
        t = x.shape[0]
        q, k, v = self._products(xp, x, wq, wk, wv)
        return q.reshape(t, h, hd), k.reshape(t, kv, hd), v.reshape(t, kv, hd)

    def swiglu(self, xp, x, w_gate, w_up, w_down):
        g, u = self._products(xp, x, w_gate, w_up)
        if x.shape[0] != 1:                                                   # the reference's arithmetic
            h = self._base.silu(xp, g) * u
        else:
            h = np.empty_like(g)
            K.silu_mul(np.ascontiguousarray(g[0]), np.ascontiguousarray(u[0]), h[0])
        return self.linear(xp, h, w_down), h

    def geglu(self, xp, x, w_gate, w_up, w_down):
        if x.shape[0] == 1:
            return self._base.geglu(xp, x, w_gate, w_up, w_down)
        h = self._base.gelu_tanh(xp, self.linear(xp, x, w_gate)) * self.linear(xp, x, w_up)   # the reference's
        return self.linear(xp, h, w_down), h

    def rope(self, xp, x, cos, sin, style):
        if style not in ("adjacent", "neox"):
            return self._base.rope(xp, x, cos, sin, style)         # (which rejects an unknown style)
        out = np.empty_like(x)
        if x.shape[0] == 1:
            K.rope_one(np.ascontiguousarray(x[0]), cos[0], sin[0], style == "neox", out[0])
        else:
            K.rope_rows(np.ascontiguousarray(x), np.ascontiguousarray(cos), np.ascontiguousarray(sin),
                        style == "neox", out)
        return out

    def attention(self, xp, q, k, v, mask, scale, kv_head):
        """One token on a float32 cache by the kernel (parallel over heads where every product runs on the
        kernels, else serial), -> (out [1, H*Hd], kq, probs); otherwise the reference's attention."""
        if q.shape[0] != 1 or k.dtype != np.float32:
            return self._base.attention(xp, q, k, v, mask, scale, kv_head)
        h, hd = q.shape[1], q.shape[2]
        n_pos = k.shape[0]
        out = np.empty((h, hd), np.float32)
        kq, probs = np.empty((h, 1, n_pos), np.float32), np.empty((h, 1, n_pos), np.float32)
        attend = K.attend_one if self._backend.all_kernels else K.attend_one_serial
        attend(np.ascontiguousarray(q[0]), k, v, mask[0], scale, kv_head, out, kq[:, 0], probs[:, 0])
        return out.reshape(1, h * hd), kq, probs

    def attention_out(self, xp, q, k, v, mask, scale, kv_head):
        """The output alone, where nobody watches: one token by the kernel, several by the reference's attention
        on groups of KV heads over the threads (cpu_split)."""
        if q.shape[0] == 1:
            return self.attention(xp, q, k, v, mask, scale, kv_head)[0]
        split = lambda xp_, q_, k_, v_, m_, s_, h_: (SPLIT.attention_out(self._base.attention, xp_, q_, k_, v_, m_,  # noqa: E731
                                                                         s_, h_), None, None)
        return attention_in_chunks(xp, split, q, k, v, mask, scale, kv_head, keep=())[0]    # a long prompt's rows


class GgmlFloatMatrix:
    """numerics="ggml": an F32 or F16 weight (ggml_cpu.FloatMatrix, whose float32 values it reads) multiplied by
    numba_ggml.float_rows, bit for bit FloatMatrix.matmul: tinyBLAS's lanes for several rows, ggml_vec_dot_f32 for
    one row or shapes tinyBLAS declines. ggml_vec_dot_f16's leftovers (K not a multiple of 4 lanes), summed in
    float64, stay with the emulation."""

    def __init__(self, fm):
        self.fm, self.qtype, self.shape, self.lanes = fm, fm.qtype, tuple(fm.shape), fm.lanes
        self.w = np.ascontiguousarray(fm.w, dtype=np.float32)

    @property
    def dtype(self):
        return np.dtype(np.float32)

    def matmul(self, x):
        n, k = self.shape
        if self.qtype == "F16" and k % (4 * self.lanes):
            return self.fm.matmul(x)
        PATHS[(self.qtype, "numba ggml kernel (float values)", "1 row" if x.shape[0] == 1 else "several rows")] += 1
        x = np.asarray(x, dtype=np.float32)
        x = np.ascontiguousarray(x.astype(np.float16).astype(np.float32) if self.qtype == "F16" else x)
        out = np.empty((x.shape[0], n), np.float32)
        G.float_rows(x, self.w, x.shape[0] > 1 and k % self.lanes == 0 and n % 4 == 0, self.lanes, out)
        return out


def _f32(a):
    return np.ascontiguousarray(a, dtype=np.float32)


class NumbaGgmlOps:
    """numerics "ggml"'s layer functions on the numba backend: ggml_cpu.make_ops's (base), with numba kernels that
    compute the same bits (tests/test_ggml_numerics.py): several new tokens' attention by numba_ggml.attend_rows,
    SwiGLU's silu(gate) * up by numba_ggml.silu_mul_rows, RMSNorm by numba_ggml.rms_norm_rows, RoPE's tables by
    the same C calls from numba; one token's attention, and everything else, as base computes it."""

    def __init__(self, base):
        own = set(dir(type(self)))
        self.__dict__.update({n: v for n, v in vars(base).items() if n not in own})
        self._base, self._half = base, base.kv_dtype == "float16"
        self._attend_rows = G.attend_rows16 if base.lanes == 16 else G.attend_rows8
        self.fusions = Fusions(attention_out=self.attention_out)

    def attention(self, xp, q, k, v, mask, scale, kv_head, skip=False):
        """skip: masked positions left out where numba_ggml.can_skip_masked finds that no bit changes."""
        if q.shape[0] == 1 or q.shape[2] % self._base.lanes:
            return self._base.attention(xp, q, k, v, mask, scale, kv_head)
        q, k, v = _f32(q), _f32(k), _f32(v)
        return self._attend_rows(q, k, v, _f32(mask), np.float32(scale), np.ascontiguousarray(kv_head, dtype=np.int64),
                                 self._half, skip and G.can_skip_masked(q, k, v, self._half))

    def attention_out(self, xp, q, k, v, mask, scale, kv_head):
        """Nobody sees kq or probs: masked positions skipped, a long prompt's query rows a chunk at a time (the
        same bits: model/attention_chunks.py), its H x T x S scores never whole."""
        skip = lambda xp_, q_, k_, v_, m_, s_, h_: self.attention(xp_, q_, k_, v_, m_, s_, h_, skip=True)  # noqa: E731
        return attention_in_chunks(xp, skip, q, k, v, mask, scale, kv_head, keep=())[0]

    def swiglu(self, xp, x, w_gate, w_up, w_down):
        h = G.silu_mul_rows(_f32(self.linear(xp, x, w_gate)), _f32(self.linear(xp, x, w_up)), self._base.lanes)
        return self.linear(xp, h, w_down), h

    def rms_norm(self, xp, x, w, eps):                 # [..., D]: every row by G.rms_norm_rows
        rows = _f32(x).reshape(-1, x.shape[-1])
        return G.rms_norm_rows(rows, _f32(w), np.float32(eps)).reshape(x.shape)

    def rope_angles(self, xp, *a, **k):
        """base's tables, with the C library's cosf/sinf called from machine code (numba_ggml.map_c_float)."""
        return self._base.rope_angles(xp, *a, map_c=G.map_c_float, **k)


def vector_registers(names=None) -> dict:
    """{kernel: the widest vector registers its machine code uses (zmm: AVX-512, ymm: AVX2/AVX, xmm: SSE), with
    counts}, read from code numba compiles for this CPU now (a fresh, uncached copy: cached code keeps no
    assembly), not assumed from the CPU's flags. Takes a few seconds per kernel."""
    import numba

    x = np.ones((1, 32), np.float32)
    d, out = np.ones((1, 1, 1), np.float32), np.empty((1, 1), np.float32)
    blk = np.zeros((1, 18), np.uint8)
    calls = {"matmul_rows": (S.TYPE_CODE["Q4_0"], np.array([blk.ctypes.data], np.int64), 1, x, out),
             "ggml_rows": (S.TYPE_CODE["Q4_0"], np.array([blk.ctypes.data], np.int64), 1, np.zeros((1, 32), np.int8),
                           d[0], d[0], out)}
    res = {}
    for name, args in calls.items():
        if names is not None and name not in names:
            continue
        f = getattr(K, name)
        g = numba.njit(**{k: v for k, v in f.targetoptions.items() if k not in ("cache", "nopython")})(f.py_func)
        g(*args)
        asm = "\n".join(g.inspect_asm().values())
        n = {r: len(re.findall(rf"%{r}\d", asm)) for r in ("zmm", "ymm", "xmm")}
        widest = next((r for r in ("zmm", "ymm", "xmm") if n[r]), "none")
        res[name] = f"{widest} ({n['zmm']} zmm, {n['ymm']} ymm, {n['xmm']} xmm operands)"
    return res


def kernels_compiled() -> int:
    """How many kernel signatures numba compiled in this process so far (its cache cold, or stale after a change to
    a kernel source) rather than loaded from its on-disk cache: a load that compiled is not a load's time."""
    import numba

    kernels = [*vars(K).values(), *vars(G).values(), *K.FOR_TYPE.values(), *K.STEP_FOR.values()]
    return sum(sum(f.stats.cache_misses.values()) for f in kernels if isinstance(f, numba.core.registry.CPUDispatcher))


def choose_spin_count(threads: int) -> str:
    """Set GOMP_SPINCOUNT to 1000 where no core is spare (NumbaBackend's comment says why), unless the user set
    it -> the value numba's OpenMP threads will read ("libgomp's default" where unset)."""
    if spare_cores(threads) < 1:
        os.environ.setdefault("GOMP_SPINCOUNT", "1000")
    return os.environ.get("GOMP_SPINCOUNT", "libgomp's default")


def _warm_calls() -> dict:
    """kernel name -> a call on tiny arguments that makes numba compile it, or load it from its cache."""
    d, o = np.ones((1, 1), np.float32), np.empty((1, 4), np.float32)
    blk = np.zeros((1, 18), np.uint8)                              # one Q4_0 block, kept alive by the closures
    row = lambda: np.array([blk.ctypes.data], np.int64)            # noqa: E731
    kv, one = np.ones((2, 1, 4), np.float32), np.ones(4, np.float32)
    attend = lambda f: f(o, kv, kv, np.zeros(2, np.float32), 0.5, np.zeros(1, np.int64), o,   # noqa: E731
                         np.empty((1, 2), np.float32), np.empty((1, 2), np.float32))
    return {"ggml_rows": lambda: K.ggml_rows(S.TYPE_CODE["Q4_0"], row(), 1, np.zeros((1, 32), np.int8), d, d,
                                             np.empty((1, 1), np.float32)),
            "rms_norm_rows": lambda: K.rms_norm_rows(o, one, 1e-5, np.empty((1, 4), np.float32)),
            "silu_mul": lambda: K.silu_mul(one, one, np.empty(4, np.float32)),
            "rope_one": lambda: K.rope_one(o, np.ones(2, np.float32), np.ones(2, np.float32), False,
                                           np.empty((1, 4), np.float32)),
            "rope_rows": lambda: K.rope_rows(o[None], np.ones((1, 2), np.float32), np.ones((1, 2), np.float32), False,
                                             np.empty((1, 1, 4), np.float32)),
            "attend_one": lambda: attend(K.attend_one), "attend_one_serial": lambda: attend(K.attend_one_serial)}


WARM_UP = _warm_calls()


def _warm_type(code):
    """matmul_rows_for(code)'s kernel called on one all-zero block of its type."""
    per, size = S.BLOCKS[S.NAMES[code]]
    blk = np.zeros((1, size), np.uint8)
    K.matmul_rows_for(code)(np.array([blk.ctypes.data], np.int64), 1, np.ones((1, per), np.float32),
                            np.empty((1, 1), np.float32))


class NumbaBackend(Backend):
    def __init__(self, threads=None):
        threads = cpu_threads(threads)
        # numba's OpenMP workers spin up to GOMP_SPINCOUNT times at each of a step's ~225 parallel regions before
        # sleeping. Where the cores are all wanted (no core spare beside this process's threads and the machine's
        # load), libgomp's default (300000) made a worker that shares its core with another process hold the core
        # against the thread doing the work: a decode 10x slower with one busy core, against 2x at 1000 spins,
        # idle speed unchanged (results/cpu/busy-cores.md); so 1000 there. With cores to spare the workers spin
        # as libgomp has them: on an idle 16-core Xeon at 2 threads a 7B Q4_K decode ran at 0.95x and 0.77x
        # llama.cpp's with 1000 spins, 1.02x with libgomp's (`llorch-ref bench --interleave`, GOMP_SPINCOUNT set
        # each way). Read when numba first
        # starts its threads (set_num_threads below); a value the user set is kept.
        global SPIN_COUNT
        if SPIN_COUNT is None:
            SPIN_COUNT = choose_spin_count(threads)
        import numba

        self.threads = min(threads, numba.config.NUMBA_NUM_THREADS)
        self._numba = numba                   # for _fit_threads, at every step
        numba.set_num_threads(self.threads)
        blas = limit_blas(threads)
        SPLIT.configure(threads, blas_controller())   # several-token BLAS work split over our threads when busy
        super().__init__(name="numba", xp=np, asarray=lambda a: a, to_numpy=lambda a: a, device="cpu",
                         info={"numba": numba.__version__, "threads": numba.get_num_threads(), "fastmath": False,
                               "gomp_spincount": SPIN_COUNT,
                               "blas": blas, "blas_split": SPLIT.mode, "kernel_types": list(S.NAMES)})
        self.n_matrices, self.all_kernels, self.prompts_in_place = 0, False, False
        self._warm_up()
        self.info["kernels_compiled"] = kernels_compiled()      # 0 when every kernel came from numba's cache

    def _warm_up(self, *names):
        """Compile (or load from the on-disk cache) the op-by-op kernels a model will run, once, before the first
        request (the ones every model runs at start; when prepare_weights knows them, the matrix products of the
        model's types (a type code: matmul_rows_for's kernel), a matrix-product kernel of numerics ggml and the
        attention variant), adding the seconds to info["compile_or_cache_load_s"]. The fused decode step
        (decode_step) and numerics "ggml"'s other kernels load on first use, in the first request (bench's
        after_load_s: 0.04 s of the default model's first decode on Zen 5)."""
        t0 = time.perf_counter()
        for name in names or ("rms_norm_rows", "silu_mul", "rope_rows"):
            if isinstance(name, str):
                WARM_UP[name]()
            else:
                _warm_type(name)
        self.info["compile_or_cache_load_s"] = round(self.info.get("compile_or_cache_load_s", 0.0)
                                                     + time.perf_counter() - t0, 3)

    def _prepare_ggml(self, weights):
        """numerics="ggml": the legacy-quant matrices (ggml_cpu.LegacyQuantMatrix) get the numba kernel ggml_rows on
        the blocks of the QTensor each carries, Q2_K..Q6_K ones (ggml_cpu.KQuantMatrix) kquant_rows, F32 and F16
        ones (ggml_cpu.FloatMatrix) float_rows (GgmlFloatMatrix)."""
        def swap(a):
            if isinstance(a, LegacyQuantMatrix):
                return GgmlKernelMatrix(a.qt)
            if isinstance(a, FloatMatrix):
                return GgmlFloatMatrix(a)
            return GgmlKQuantMatrix(a.qt) if isinstance(a, KQuantMatrix) and a.qtype in G.KQUANT_TYPES else a
        layers = [type(lw)(**{k: swap(v) for k, v in vars(lw).items()}) for lw in weights.layers]
        mats = [a for lw in layers for a in vars(lw).values()]
        self.n_matrices = sum(isinstance(a, (_GgmlMatrix, GgmlFloatMatrix)) for a in mats)
        if any(isinstance(a, GgmlKernelMatrix) for a in mats):
            self._warm_up("ggml_rows")
        self.prompts_in_place = self.n_matrices > 0
        self.info["prompts"] = ("ggml kernels on the blocks" if any(isinstance(a, _GgmlMatrix) for a in mats)
                                else "ggml kernels on the float values" if self.n_matrices
                                else "ggml_cpu's NumPy emulation")
        return type(weights)(tok_embd=weights.tok_embd, layers=layers, out_norm=weights.out_norm,
                             output=swap(weights.output), pos_embd=weights.pos_embd, out_norm_b=weights.out_norm_b)

    def prepare_weights(self, weights, qtensors=None, numerics="exact"):
        """qtensors: (layer, field) and "output" -> QTensor from the GGUF loader.

        Every matrix of a KERNEL_TYPES type becomes a KernelMatrix handle: one-token products by the kernels,
        several-token ones by BLAS on the float32 weight (eager, or dequantized on use from lazy weights). Q/K/V
        and gate/up of a layer, when of one type, are stacked by rows (KernelBlocks of several QTensors) so that
        a decode step runs one kernel for each group. numerics="ggml": see _prepare_ggml."""
        if numerics == "ggml":
            return self._prepare_ggml(weights)
        qts = {k: q for k, q in (qtensors or {}).items() if q.qtype in KERNEL_TYPES}
        handles = []
        for i in range(len(weights.layers)):
            own = {key[1]: q for key, q in qts.items() if key != "output" and key[0] == i}
            mats = {}
            for group in (("wq", "wk", "wv"), ("w_gate", "w_up")):
                parts = [own.get(fld) for fld in group]
                if all(p is not None and (p.qtype, p.shape[1]) == (parts[0].qtype, parts[0].shape[1]) for p in parts):
                    f = KernelBlocks(parts)
                    bounds = np.cumsum([0] + [p.shape[0] for p in parts])
                    for fld, lo, hi in zip(group, bounds[:-1], bounds[1:]):
                        mats[fld] = (f, int(lo), int(hi))
                        del own[fld]
            mats.update({fld: (KernelBlocks([q]), 0, q.shape[0]) for fld, q in own.items()})
            handles.append(mats)
        out = qts.get("output")
        out = (KernelBlocks([out]), 0, out.shape[0]) if out is not None else None
        self.n_matrices = sum(map(len, handles)) + (out is not None)
        self.info["kernel_matrices"] = self.n_matrices
        # a decode step with any product left to BLAS runs numba's attention serially (attend_one_serial)
        self.all_kernels = out is not None and all(set(h) >= set(MATRIX_FIELDS) for h in handles)
        codes = sorted({blocks.code for h in handles for blocks, _, _ in h.values()} | ({out[0].code} if out else set()))
        self._warm_up(*codes, "attend_one" if self.all_kernels else "attend_one_serial")
        lazy = getattr(weights, "lazy", False)
        if lazy and self.all_kernels:       # prompts too on the blocks: no float32 copy unless --weight-cache-mb
            weights.cache.shrink_default(0)
        self.prompts_in_place = lazy and not all(weights.layers.keeps(i) for i in range(len(weights.layers)))
        self.info["prompts"] = "kernels on the blocks" if self.prompts_in_place else "BLAS on float32 weights"
        return NumbaWeights(weights, handles, out)

    def before_forward(self, n_tokens):
        """Before every forward, in the thread that runs it: a prompt on the kernels runs with BLAS on one thread
        (SPLIT.prefer_split), other forwards take cpu_split's look; then _fit_threads."""
        if n_tokens > 1 and self.prompts_in_place:
            SPLIT.measure()
            SPLIT.prefer_split()
        else:
            SPLIT.look()
        self._fit_threads(n_tokens == 1)

    def before_step(self):
        """Before every fused one-token step (its products all on the kernels): cpu_split's measure only, BLAS's
        thread count left as the prompt set it (set back and forth at each request, OpenBLAS's woken threads spun
        beside numba's); then _fit_threads."""
        SPLIT.measure()
        self._fit_threads(True)

    def _fit_threads(self, one_token):
        """numba's threads for the calling thread: --threads; for one-token steps fewer while other processes hold
        cores (SPLIT.spare_threads). numba keeps a thread count per calling thread (a new thread, the server's
        worker, starts at NUMBA_NUM_THREADS). Each of a step's ~200 parallel regions waits for its slowest thread:
        with one of 2 cores held by another process a 2-thread step on 2 threads throughout runs 3.8x slower than
        idle, 1.6x slower than one thread (`python tools/busy_cores.py`); a prompt's few long regions lose less than
        its second thread
        gains. Every product and attention head is one thread's work: the results do not depend on the count."""
        n = SPLIT.spare_threads(self.threads) if one_token else self.threads
        if self._numba.get_num_threads() != n:
            self._numba.set_num_threads(n)

    def make_decoder(self, engine, cache):
        """One-token steps by FusedDecoder where the model allows it (settings' numba_fused off: never), else the
        backend's forward."""
        fused = GgmlFusedDecoder if engine.numerics == "ggml" else FusedDecoder
        plans = fused.plan(engine, cache) if settings().numba_fused else None
        self.info["fused_decode"] = plans is not None
        if plans is None:
            return super().make_decoder(engine, cache)
        return fused(engine, cache, plans)

    def make_ggml_ops(self, ggml_ops):
        """-> NumbaGgmlOps over ggml_ops (ggml_cpu.make_ops's)."""
        return NumbaGgmlOps(ggml_ops)

    def make_ops(self, base_ops):
        """-> NumbaOps over base_ops (model.layers), reading this backend's all_kernels at each attention."""
        return NumbaOps(base_ops, self)

    def forward(self, xp, cfg, weights, tokens, cache, ops, rows=None, boundary=None):
        """Where nobody watches: the reference's steps with attention's output alone (attention_out: one token by
        the kernel, several with the masked positions skipped or split over the threads)."""
        return fused_forward(xp, cfg, weights, tokens, cache, ops, ops.fusions, rows=rows, boundary=boundary)
