"""The Numba backend: NumPy arrays, with decode-time matrix-vector products computed from the quantized
GGUF blocks by Numba kernels (prefill keeps BLAS on the dequantized weights), and Numba RMSNorm/SwiGLU."""
from __future__ import annotations

import os
import time
import types

import numpy as np

from . import Backend

KERNEL_TYPES = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K")


class QuantBlocks:
    """The GGUF blocks of one weight, unpacked once into what the kernels read."""

    def __init__(self, raw, qtype):
        from ..numerics.ggml_cpu import _f16

        n = raw.shape[0]
        self.qtype, self.n = qtype, n
        self.chunks = 8 if n >= 1024 else 2
        if qtype in ("Q4_K", "Q6_K"):
            self._init_k(np.asarray(raw), qtype)
            return
        size = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}[qtype]
        blk = np.asarray(raw).reshape(n, -1, size)
        # block-major, row-minor layouts (see numba_kernels): qs [B, 16|32, N], d and m [B, N]
        self.d = np.ascontiguousarray(_f16(blk, 0).T)
        if qtype == "Q4_0":
            qs, self.m = blk[..., 2:18], None
        elif qtype == "Q4_1":
            qs, self.m = blk[..., 4:20], np.ascontiguousarray(_f16(blk, 2).T)
        else:
            qs, self.m = blk[..., 2:34].view(np.int8), None
        self.qs = np.ascontiguousarray(qs.transpose(1, 2, 0))

    def _init_k(self, raw, qtype):
        """K-quants as affine groups: w = a * q + c, codes block-major and row-minor ([G, S, N])."""
        from ..numerics.ggml_cpu import _f16, _k4_scales

        n = self.n
        if qtype == "Q4_K":
            blk = raw.reshape(n, -1, 144)
            d, dmin = _f16(blk, 0), _f16(blk, 2)
            sc, mn = _k4_scales(blk[..., 4:16])                                      # [N, NB, 8]
            qs = blk[..., 16:144].reshape(n, -1, 4, 32)
            q = np.stack([qs & 15, qs >> 4], axis=3).reshape(n, -1, 8, 32)           # [N, NB, 8, 32]
            a = d[..., None] * sc.astype(np.float32)
            c = -(dmin[..., None] * mn.astype(np.float32))
            gs = 32
        else:
            blk = raw.reshape(n, -1, 210)
            ql, qh = blk[..., 0:128].astype(np.int32), blk[..., 128:192].astype(np.int32)
            sc = blk[..., 192:208].view(np.int8).astype(np.float32)                  # [N, NB, 16]
            d = _f16(blk, 208)
            parts = []
            for j in range(2):
                l0, l1, h = ql[..., 64 * j:64 * j + 32], ql[..., 64 * j + 32:64 * j + 64], qh[..., 32 * j:32 * j + 32]
                parts += [(l0 & 15) | ((h & 3) << 4), (l1 & 15) | (((h >> 2) & 3) << 4),
                          (l0 >> 4) | (((h >> 4) & 3) << 4), (l1 >> 4) | (((h >> 6) & 3) << 4)]
            q = np.concatenate(parts, axis=-1).reshape(n, -1, 16, 16).astype(np.uint8)  # [N, NB, 16, 16]
            a = d[..., None] * sc
            c = np.float32(-32) * a
            gs = 16
        self.qs = np.ascontiguousarray(q.reshape(n, -1, gs).transpose(1, 2, 0).astype(np.uint8))
        self.a = np.ascontiguousarray(a.reshape(n, -1).T.astype(np.float32))
        self.c = np.ascontiguousarray(c.reshape(n, -1).T.astype(np.float32))
        self.d = self.m = None

    def matvec(self, x):
        from . import numba_kernels as K

        if self.qtype in ("Q4_K", "Q6_K"):
            out = np.empty(self.n, dtype=np.float32)
            K.matvec_affine_u8(self.qs, self.a, self.c, np.ascontiguousarray(x, dtype=np.float32), out, self.chunks)
            return out

        out = np.empty(self.n, dtype=np.float32)
        x = np.ascontiguousarray(x, dtype=np.float32)
        if self.qtype == "Q4_0":
            K.matvec_q4_0(self.qs, self.d, x, out, self.chunks)
        elif self.qtype == "Q4_1":
            K.matvec_q4_1(self.qs, self.d, self.m, x, out, self.chunks)
        else:
            K.matvec_q8_0(self.qs, self.d, x, out, self.chunks)
        return out


class NumbaBackend(Backend):
    def __init__(self, threads=None):
        import numba

        threads = int(threads or os.environ.get("LLORCH_THREADS") or os.cpu_count() or 1)
        numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
        super().__init__(name="numba", xp=np, asarray=lambda a: a, to_numpy=lambda a: a, device="cpu",
                         info={"numba": numba.__version__, "threads": numba.get_num_threads(), "fastmath": False})
        self.blocks = {}
        t0 = time.perf_counter()
        self._warm_up()
        self.info["compile_or_cache_load_s"] = round(time.perf_counter() - t0, 3)

    def _warm_up(self):
        """Compile (or load from the on-disk cache) every kernel once, outside any timed region."""
        from . import numba_kernels as K

        x = np.ones(32, np.float32)
        out = np.empty(1, np.float32)
        d = np.ones((1, 1), np.float32)
        K.matvec_q4_0(np.zeros((1, 16, 1), np.uint8), d, x, out, 1)
        K.matvec_q4_1(np.zeros((1, 16, 1), np.uint8), d, d, x, out, 1)
        K.matvec_q8_0(np.zeros((1, 32, 1), np.int8), d, x, out, 1)
        K.matvec_affine_u8(np.zeros((1, 32, 1), np.uint8), d, d, x, out, 1)
        K.rms_norm_rows(np.ones((1, 4), np.float32), np.ones(4, np.float32), 1e-5, np.empty((1, 4), np.float32))
        K.silu_mul(np.ones((1, 4), np.float32), np.ones((1, 4), np.float32), np.empty((1, 4), np.float32))

    def prepare_weights(self, weights, raw_tensors=None):
        """raw_tensors: {id(float32 weight): (ggml type name, raw uint8 blocks)} from the GGUF loader."""
        for key, (qtype, raw) in (raw_tensors or {}).items():
            if qtype in KERNEL_TYPES:
                self.blocks[key] = QuantBlocks(raw, qtype)
        return weights

    def make_ops(self, base_ops):
        from . import numba_kernels as K

        blocks = self.blocks
        ops = types.SimpleNamespace(**{n: getattr(base_ops, n) for n in dir(base_ops) if not n.startswith("_")})

        def linear(xp, x, w):
            q = blocks.get(id(w))
            if q is not None and x.shape[0] == 1:
                return q.matvec(x[0])[None, :]
            return x @ w.T

        # Numba kernels serve single-token steps only: for several rows the work goes to BLAS, and Numba's
        # worker threads would compete with BLAS's for the same cores.
        def rms_norm(xp, x, w, eps):
            if x.shape[0] != 1:
                return base_ops.rms_norm(xp, x, w, eps)
            rows = np.ascontiguousarray(x).reshape(-1, x.shape[-1])      # [1, D], or [1, heads, Hd] (QK-norm)
            out = np.empty_like(rows)
            K.rms_norm_rows(rows, w, eps, out)
            return out.reshape(x.shape)

        def swiglu(xp, x, w_gate, w_up, w_down):
            if x.shape[0] != 1:
                return base_ops.swiglu(xp, x, w_gate, w_up, w_down)
            g, u = linear(xp, x, w_gate), linear(xp, x, w_up)
            h = np.empty_like(g)
            K.silu_mul(np.ascontiguousarray(g), np.ascontiguousarray(u), h)
            return linear(xp, h, w_down), h

        def qkv(xp, x, wq, wk, wv, h, kv, hd):
            t = x.shape[0]
            return (linear(xp, x, wq).reshape(t, h, hd), linear(xp, x, wk).reshape(t, kv, hd),
                    linear(xp, x, wv).reshape(t, kv, hd))

        ops.linear, ops.rms_norm, ops.swiglu, ops.qkv = linear, rms_norm, swiglu, qkv
        return ops
