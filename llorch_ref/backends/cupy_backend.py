"""CuPy: the same layer functions over `cupy`, weights uploaded once, no host round trip per layer.

float32 by default with TF32 off (CUPY_TF32=0, set before cupy is imported); dtype="float16" stores the
2-D weights in float16 and runs the matrix products in float16 (activations cast per product),
everything else (norms, RoPE, softmax, the residual stream) stays float32. dtype="blocks" keeps quantized
matrices as the file's GGUF blocks on the device and multiplies them by cuda_blocks' kernels.
"""
from __future__ import annotations

import dataclasses
import os
import types

import numpy as np

from ..errors import ParameterError
from ..model.cache import visible_mask
from ..model.weights import LayerWeights, Weights
from . import Backend
from .cuda_blocks import TYPES as BLOCK_TYPES
from .cuda_blocks import GpuBlocks
from .cuda_fused import FusedStep
from .cuda_half import half_attention, half_attention_core, half_gemm
from .cuda_source import cuda_source
from .fused_forward import Fusions
from .fused_forward import forward as fused_forward
from .settings import settings


class CupyBackend(Backend):
    def __init__(self, dtype="float32"):
        os.environ.setdefault("CUPY_TF32", "0")
        os.environ.setdefault("CUPY_ACCELERATORS", "")     # plain reduction kernels: capturable in a CUDA graph
        import cupy

        dev = cupy.cuda.Device()
        props = cupy.cuda.runtime.getDeviceProperties(dev.id)
        graphs = settings().cuda_graphs
        super().__init__(name="cupy", xp=cupy, asarray=cupy.asarray, to_numpy=cupy.asnumpy,
                         device=f"cuda:{dev.id} {props['name'].decode()}", dtype=dtype,
                         info={"tf32": os.environ.get("CUPY_TF32"), "cupy": cupy.__version__,
                               "cuda_graphs": graphs})
        self.step_argmax = {}     # a replayed graph's logits (data address) -> (logits, ring, slot of its argmax)

    def cache_class(self, base_cls):
        return DeviceCache.make(base_cls)

    def make_decoder(self, engine, cache):
        return GraphDecoder(engine, cache)

    def prepare_weights(self, weights, qtensors=None, numerics="exact"):
        """float32: every array uploaded; float16: 2-D weights stored in float16; blocks: every matrix with a
        QTensor of a type cuda_blocks multiplies (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K) uploaded as its blocks, the
        rest in float32. Then each layer's Q/K/V and gate/up matrices are stacked in one allocation (the
        fields stay views of it), so that a decode step reads each group with one kernel (joined)."""
        cp = self.xp
        if self.dtype == "blocks":
            weights = self._blocks_weights(weights, qtensors or {})
        elif self.dtype == "float32":
            weights = weights.map(cp.asarray)
        else:
            def up(a):
                if a is None:                         # absent biases (llama) stay absent
                    return None
                return cp.asarray(a, dtype=cp.float16 if a.ndim == 2 else cp.float32)
            weights = Weights(tok_embd=cp.asarray(weights.tok_embd, dtype=cp.float32),  # embedding rows stay f32
                              layers=[LayerWeights(**{k: up(v) for k, v in vars(lw).items()}) for lw in weights.layers],
                              out_norm=cp.asarray(weights.out_norm), output=up(weights.output))
        for lw in weights.layers:
            for group in (("wq", "wk", "wv"), ("w_gate", "w_up")):
                parts = stacked([getattr(lw, f) for f in group], cp)
                if parts is not None:
                    for f, v in zip(group, parts):
                        setattr(lw, f, v)
        return weights

    def _blocks_weights(self, weights, qtensors):
        cp = self.xp
        gpu = {k: GpuBlocks.from_qtensor(q, cp) for k, q in qtensors.items() if q.qtype in BLOCK_TYPES}
        made = [v for lw in weights.layers for v in vars(lw).values() if isinstance(v, GpuBlocks)]
        if not gpu and made:                  # weights built on the device (random models of tools/)
            self.info["blocks_mb"] = round(sum(g.nbytes for g in made) / 2**20, 1)
            return weights
        if not gpu:
            kinds = sorted({q.qtype for q in qtensors.values()}) or ["none (a float file)"]
            raise ParameterError(f"--dtype blocks needs quantized matrices of a type the GPU kernels read "
                                 f"({', '.join(BLOCK_TYPES)}); this model's: {', '.join(kinds)}")
        self.info["blocks_mb"] = round(sum(g.nbytes for g in gpu.values()) / 2**20, 1)
        self.info["blocks_types"] = sorted({g.qtype for g in gpu.values()})

        def up(a):
            return None if a is None else cp.asarray(a)

        def field(i, name):                 # lazy weights: only what the GPU does not read as blocks
            if (i, name) in gpu:
                return gpu[(i, name)]
            return up(weights.layers.field(i, name) if weights.lazy else getattr(weights.layers[i], name, None))
        names = [f.name for f in dataclasses.fields(LayerWeights)]
        layers = []
        for i in range(len(weights.layers)):
            got = {}
            for name in names:
                try:
                    got[name] = field(i, name)
                except AttributeError:      # a field this model does not have (biases, QK-norm)
                    got[name] = None
            layers.append(LayerWeights(**got))
        emb = weights.tok_embd
        emb = emb[np.arange(emb.shape[0])] if weights.lazy else emb
        output = gpu.get("output")
        return Weights(tok_embd=cp.asarray(emb, dtype=cp.float32), layers=layers, out_norm=cp.asarray(weights.out_norm),
                       output=output if output is not None else up(weights.output))

    def make_ops(self, base_ops):
        """Hot kernels, written without cuBLAS where a decode step needs them so that it can be captured as a
        CUDA graph (CuPy refuses cuBLAS calls during capture): a warp-per-row GEMV for one-token products
        (several tokens use cuBLAS), and fused RMSNorm, RoPE, attention and gated-activation kernels."""
        cp = self.xp
        ops = types.SimpleNamespace(**{n: getattr(base_ops, n) for n in dir(base_ops) if not n.startswith("_")})
        ops.static_decode = False          # True while GraphDecoder runs a step over the preallocated cache
        K = _kernels(cp)
        i32, f32 = cp.int32, cp.float32
        # several-token float16 products with float32 results and generation's prefill attention in float16
        # products (cuda_half); settings' cuda_half_prefill off: CuPy's float16 matmul cast back, attention as recorded
        half_prefill = settings().cuda_half_prefill

        def linear(xp, x, w):
            if isinstance(w, GpuBlocks):
                return w.matmul(x)
            if x.shape[0] == 1 and w.ndim == 2:
                y = cp.empty((1, w.shape[0]), dtype=cp.float32)
                n, kdim = w.shape
                half = w.dtype == cp.float16
                vec = (kdim % 8 == 0) if half else (kdim % 4 == 0)
                xv = cp.ascontiguousarray(x[0], dtype=cp.float32)
                if not half and vec:                          # float32 rows: a block of 128 threads per row
                    K["gemv_f32_row"]((n,), (128,), (w, xv, y, i32(n), i32(kdim)))
                    return y
                if half and vec:                              # a warp per row, 4 loads of 16 bytes in flight
                    K["gemv_f16_x4"](((n + 3) // 4,), (128,), (w, xv, y, i32(n), i32(kdim)))
                    return y
                k = K["gemv_f16" if half else "gemv_f32"]     # a warp per row
                k(((n + 7) // 8,), (256,), (w, xv, y, i32(n), i32(kdim)))
                return y
            if w.dtype == cp.float16:                         # float16 products, float32 results (cuBLAS)
                return half_gemm(cp, x, w) if half_prefill else (x.astype(cp.float16) @ w.T).astype(cp.float32)
            return x @ w.T

        def dense(a):
            """a as a C-contiguous float32 array (itself when it is one: no call into CuPy)."""
            return a if a.dtype == f32 and a.flags.c_contiguous else cp.ascontiguousarray(a, dtype=f32)

        def rms_norm(xp, x, w, eps):
            x = dense(x)
            y = cp.empty_like(x)
            n = w.shape[0]
            K["rms_norm_rows"]((x.size // n,), (256,), (x, w, y, i32(n), f32(eps)))
            return y

        def add_norm(xp, x, a, w, eps):
            """A residual add and the RMSNorm after it in one kernel (Fusions.add_norm, where nobody watches): -> (x + a,
            its RMSNorm), a None: (x, RMSNorm of x). The sum as x + a, the norm as rms_norm's, to the bit; the normed
            rows in float16 where several-token float16 products take them next (they round them so anyway)."""
            x = dense(x)
            n = w.shape[0]
            half = self.dtype == "float16" and x.shape[0] > 1
            y = cp.empty(x.shape, dtype=cp.float16 if half else f32)
            if a is None:
                K["rms_norm_rows_f16" if half else "rms_norm_rows"]((x.size // n,), (256,), (x, w, y, i32(n), f32(eps)))
                return x, y
            s = cp.empty_like(x)
            K["add_rms_norm_f16" if half else "add_rms_norm_f32"]((x.size // n,), (256,),
                                                                  (x, dense(a), s, w, y, i32(n), f32(eps)))
            return s, y

        def rope(xp, x, cos, sin, style):
            """x: [T, nh, Hd]; read in place when each token's heads are contiguous (a slice of the stacked Q/K/V
            product's rows), else copied first."""
            t, nh, hd, half = x.shape[0], x.shape[1], x.shape[2], cos.shape[-1]
            if not (x.dtype == f32 and x.strides[2] == 4 and x.strides[1] == 4 * hd and x.strides[0] % 4 == 0):
                x = cp.ascontiguousarray(x, dtype=f32)
            y = cp.empty((t, nh, hd), dtype=f32)
            total = t * nh * (hd - half)
            K["rope_rows"](((total + 255) // 256,), (256,), (x, dense(cos), dense(sin), y, i32(t), i32(nh), i32(hd),
                                                            i32(half), i32(style == "neox"),
                                                            cp.int64(x.strides[0] // 4)))
            return y

        def parts(x, ws):
            """The products with matrices stacked in one allocation by one GEMV (one token) or one cuBLAS product
            (several: one cast of x, one larger GEMM); matrices apart, each on its own."""
            whole = joined(ws, cp)
            if whole is None:
                return [linear(cp, x, w) for w in ws]
            y = linear(cp, x, whole)
            bounds = [0]
            for w in ws:
                bounds.append(bounds[-1] + w.shape[0])
            return [y[:, lo:hi] for lo, hi in zip(bounds[:-1], bounds[1:])]

        def qkv(xp, x, wq, wk, wv, h, kv, hd):
            t = x.shape[0]
            q, k, v = parts(x, (wq, wk, wv))
            return q.reshape(t, h, hd), k.reshape(t, kv, hd), v.reshape(t, kv, hd)

        def glu(x, w_gate, w_up, w_down, gelu):
            """The gated FFN, act(g) * u in one kernel read from the gate/up rows where they are; on float16 input
            (add_norm's, where nobody watches) the hidden rows come in float16 too, for the down product that
            would round them so."""
            g, u = parts(x, (w_gate, w_up))
            if not (g.dtype == u.dtype == f32 and g.strides == u.strides and g.strides[1] == 4):
                g, u = dense(g), dense(u)
            t, nf = g.shape
            half = x.dtype == cp.float16
            h = cp.empty((t, nf), dtype=cp.float16 if half else f32)
            K["glu_f16" if half else "glu_f32"](((t * nf + 255) // 256,), (256,),
                                                (g, u, cp.int64(g.strides[0] // 4), h, i32(nf), cp.int64(t * nf),
                                                 i32(gelu)))
            return linear(cp, h, w_down), h

        def swiglu(xp, x, w_gate, w_up, w_down):
            return glu(x, w_gate, w_up, w_down, False)

        def geglu(xp, x, w_gate, w_up, w_down):
            return glu(x, w_gate, w_up, w_down, True)

        def attention(xp, q, k, v, mask, scale, kv_head):
            """One token: one fused kernel per layer (scores, softmax, P.V), one block per head. Every
            forward the harness can record: kq holds every raw dot, as the reference's. A decode step over the
            whole preallocated cache (GraphDecoder sets ops.static_decode): masked keys are not read, and kq
            holds 0 there."""
            if q.shape[0] != 1:                 # several tokens: batched cuBLAS products and one softmax kernel
                return attention_rows(q, k, v, mask, scale, kv_head)
            hd = q.shape[2]
            threads = 1024 if hd <= 1024 else 0
            smem = 4 * (k.shape[0] + (threads // max(hd, 1)) * hd)      # scores + partial sums (48 KB max)
            if not threads or smem > 48 * 1024:
                return base_ops.attention(xp, q, k, v, mask, scale, kv_head)
            t, h = q.shape[0], q.shape[1]
            s_len, kv = k.shape[0], k.shape[1]
            kq = cp.empty((h, t, s_len), dtype=cp.float32)
            probs = cp.empty((h, t, s_len), dtype=cp.float32)
            out = cp.empty((t, h * hd), dtype=cp.float32)
            K["attend"]((h, t), (threads,), (cp.ascontiguousarray(q, dtype=cp.float32), cp.ascontiguousarray(k),
                                             cp.ascontiguousarray(v), cp.ascontiguousarray(mask, dtype=cp.float32),
                                             kq, probs, out, i32(t), i32(s_len), i32(h), i32(kv), i32(hd),
                                             f32(scale), i32(not ops.static_decode)), shared_mem=smem)
            return out, kq, probs

        def attention_rows(q, k, v, mask, scale, kv_head):
            """The reference's attention for several tokens (layers.attention): q.k^T and P.V as batched cuBLAS
            products (K/V heads repeated only where there are fewer of them), the softmax of kq * scale + mask
            in one kernel (the same float32 operations, the sum in float64) instead of seven passes."""
            t, h, hd = q.shape
            s_len, kv = k.shape[0], k.shape[1]
            kh = k if kv == h else k[:, kv_head, :]
            kq = cp.matmul(q.transpose(1, 0, 2), kh.transpose(1, 2, 0))                  # [H, T, S]
            probs = cp.empty_like(kq)
            K["softmax_rows"]((h * t,), (256,), (cp.ascontiguousarray(kq), cp.ascontiguousarray(mask, dtype=f32),
                                                 probs, f32(scale), i32(s_len), i32(t)))
            vh = (v if kv == h else v[:, kv_head, :]).transpose(1, 0, 2)                  # [H, S, Hd]
            return cp.matmul(probs, vh).transpose(1, 0, 2).reshape(t, -1), kq, probs

        def attention_out(xp, q, k, v, mask, scale, kv_head):
            """Several tokens that no recorder watches (the fused forward asks for the output only): with float16
            weights, Q.K and P.V as float16 cuBLAS products (kq and probs never recorded), the output in float16 for
            the output projection's float16 product; otherwise the recorded path's output."""
            if q.shape[0] == 1 or self.dtype != "float16" or not half_prefill:
                return attention(xp, q, k, v, mask, scale, kv_head)[0]
            return half_attention(cp, q, k, v, mask, scale, K["softmax_rows_f16"])

        def rope_store_attend(xp, q, k, v, cos, sin, style, cache, layer, window, scale, kv_head):
            """Several tokens that no recorder watches, float16 weights, q/k/v straight from the stacked Q/K/V
            product: RoPE, the cache write and the float16 head-major copies in one kernel (rope_store), then the
            attention's batched products (cuda_half) -> the attention output [T, H*Hd] in float16; None where that
            does not apply (fused_forward.attend then runs the operations one by one)."""
            t, h, hd = q.shape
            kv = k.shape[1]
            row = q.strides[0]
            if t == 1 or self.dtype != "float16" or not half_prefill or style not in ("adjacent", "neox") \
                    or getattr(cache, "static", False) or q.dtype != f32 or cache.k.dtype not in (f32, cp.float16) \
                    or not (k.strides[0] == v.strides[0] == row and q.strides[1:] == k.strides[1:] == v.strides[1:]
                            == (4 * hd, 4) and k.data.ptr == q.data.ptr + 4 * h * hd
                            and v.data.ptr == q.data.ptr + 4 * (h + kv) * hd):
                return None
            pos, half = cache.pos, cos.shape[-1]
            s_len = pos + t
            q16 = cp.empty((h, t, hd), dtype=cp.float16)
            k16, v16 = cp.empty((kv, s_len, hd), dtype=cp.float16), cp.empty((kv, s_len, hd), dtype=cp.float16)
            if pos:                                         # the cached prefix, as float16 in head-major order
                k16[:, :pos] = cache.k[layer, :pos].transpose(1, 0, 2)
                v16[:, :pos] = cache.v[layer, :pos].transpose(1, 0, 2)
            n = t * (h + 2 * kv) * hd
            K["rope_store_f16" if cache.k.dtype == cp.float16 else "rope_store_f32"](
                ((n + 255) // 256,), (256,), (q, cp.int64(row // 4), dense(cos), dense(sin), cache.k[layer],
                                              cache.v[layer], q16, k16, v16, i32(t), i32(h), i32(kv), i32(hd),
                                              i32(half), i32(style == "neox"), i32(pos), i32(s_len)))
            return half_attention_core(cp, q16, k16, v16, cache.mask(t, window), scale, K["softmax_rows_f16"])

        kv_heads = {}

        def kv_head_of(xp, n_heads, n_kv_heads):          # the same small index array for every layer
            if (n_heads, n_kv_heads) not in kv_heads:
                kv_heads[(n_heads, n_kv_heads)] = base_ops.kv_head_of(xp, n_heads, n_kv_heads)
            return kv_heads[(n_heads, n_kv_heads)]

        ops.linear, ops.qkv, ops.swiglu, ops.geglu, ops.attention = linear, qkv, swiglu, geglu, attention
        ops.attention_out, ops.rope_store_attend = attention_out, rope_store_attend
        fused_norm = settings().cuda_fused_norm              # off: the adds and norms one by one
        ops.fusions = Fusions(attention_out=attention_out, rope_store_attend=rope_store_attend,
                              add_norm=add_norm if fused_norm else None)
        ops.kv_head_of = kv_head_of
        ops.rms_norm, ops.rope = rms_norm, rope
        return ops

    def forward(self, xp, cfg, weights, tokens, cache, ops, rows=None, boundary=None):
        """Where nobody watches: the reference's steps with the fusions of make_ops (the residual add with the next
        RMSNorm; with float16 weights, RoPE, the cache write and attention of a prompt, and activations that only
        feed float16 products carried in float16)."""
        return fused_forward(xp, cfg, weights, tokens, cache, ops, ops.fusions, rows=rows, boundary=boundary)

    def synchronize(self):
        self.xp.cuda.get_current_stream().synchronize()

    def argmax(self, logits) -> int:
        """On the device (argmax_row, np.argmax's answer on ties and NaN: tests/test_backends.py), written into
        host memory the GPU maps: one launch and a wait instead of the whole row copied back (CuPy's own argmax
        costs more than the copy)."""
        cp = self.xp
        # logits a replayed decode graph just made carry the argmax it took (the entry holds them alive, so their
        # address is theirs; nothing writes into a step's logits); the first argmax after the replay consumes it
        done = self.step_argmax.pop(logits.data.ptr, None)
        if done is not None and logits.size == done[0].size and logits.dtype == done[0].dtype:
            return int(done[1].host[done[2]])
        if getattr(self, "_argmax_host", None) is None:
            self._argmax_host = MappedHost(cp, 1, np.int64)
        x = cp.ascontiguousarray(logits, dtype=cp.float32).reshape(-1)
        _kernels(cp)["argmax_row"]((1,), (1024,), (x, np.int32(x.size), self._argmax_host.device))
        cp.cuda.get_current_stream().synchronize()
        return int(self._argmax_host.host[0])


def stacked(ws, cp):
    """Matrices of one kind and input size (float arrays of one dtype, or GpuBlocks of one type) -> the same
    matrices as views of one stacked allocation (rows of ws[0], then ws[1], ...), or None."""
    if all(isinstance(w, GpuBlocks) for w in ws) and len({(w.qtype, w.shape[1]) for w in ws}) == 1:
        joined = GpuBlocks(ws[0].qtype, (sum(w.shape[0] for w in ws), ws[0].shape[1]),
                           cp.concatenate([w.blocks for w in ws]), cp)
    elif all(isinstance(w, cp.ndarray) and w.ndim == 2 for w in ws) and len({(w.dtype, w.shape[1]) for w in ws}) == 1:
        joined = cp.concatenate(ws)
    else:
        return None
    bounds = [0]
    for w in ws:
        bounds.append(bounds[-1] + w.shape[0])
    return [joined[lo:hi] for lo, hi in zip(bounds[:-1], bounds[1:])]


def joined(ws, cp):
    """Views of consecutive rows of one allocation (as stacked() leaves them) -> one matrix over all their rows,
    or None."""
    w0 = ws[0]
    if isinstance(w0, GpuBlocks):
        if not all(isinstance(w, GpuBlocks) and w.qtype == w0.qtype for w in ws):
            return None
        arrs = [w.blocks for w in ws]
    elif all(isinstance(w, cp.ndarray) and w.ndim == 2 and w.dtype == w0.dtype for w in ws):
        arrs = ws
    else:
        return None
    if not all(a.flags.c_contiguous and a.shape[1:] == arrs[0].shape[1:] for a in arrs) or any(
            a.data.ptr + a.nbytes != b.data.ptr for a, b in zip(arrs[:-1], arrs[1:])):
        return None
    rows = sum(a.shape[0] for a in arrs)
    whole = cp.ndarray((rows,) + arrs[0].shape[1:], dtype=arrs[0].dtype, memptr=arrs[0].data)
    return GpuBlocks(w0.qtype, (rows, w0.shape[1]), whole, cp) if isinstance(w0, GpuBlocks) else whole


def _or(a, b):
    return b if a is None else a


class DeviceCache:
    """A Cache whose decode steps read the position from device memory, so one decode step has static
    shapes (attention over all n_ctx slots, later ones masked) and can be captured as a CUDA graph.
    Prefill (several tokens) uses the ordinary host-indexed path."""

    @staticmethod
    def make(base_cls):
        class _DeviceCache(base_cls):
            def __init__(self, xp, cfg, n_ctx, kv_dtype="float32", ops=None):
                super().__init__(xp, cfg, n_ctx, kv_dtype=kv_dtype, **({"ops": ops} if ops is not None else {}))
                self.pos_dev = xp.zeros(1, dtype=xp.int64)
                self.k_pos = xp.arange(self.n_ctx)
                self.static = False          # True while a decode step runs on device-side positions

            def reset(self):
                super().reset()
                self.pos_dev[...] = 0

            def rope_rows(self, n_new, local=False):
                if not self.static:
                    return super().rope_rows(n_new, local)
                key = ("static-rope", local)
                if key not in self._memo:
                    cos, sin = self.tables(local)
                    self._memo[key] = (cos[self.pos_dev], sin[self.pos_dev])
                return self._memo[key]

            def store(self, layer, k, v):
                if not self.static:
                    return super().store(layer, k, v)
                xp = self.xp
                n = k.size
                name = "kv_store_f32" if self.kv_dtype == xp.float32 else "kv_store_f16"
                _kernels(xp)[name](((n + 255) // 256,), (256,),            # both rows at pos_dev, one launch
                                   (xp.ascontiguousarray(k, dtype=xp.float32), xp.ascontiguousarray(v, dtype=xp.float32),
                                    self.k[layer], self.v[layer], self.pos_dev, xp.int32(n)))
                return (self.k[layer].astype(xp.float32, copy=False), self.v[layer].astype(xp.float32, copy=False))

            def mask(self, n_new, window=0):
                if not self.static:
                    return super().mask(n_new, window)
                key = ("static-mask", window)
                if key not in self._memo:
                    self._memo[key] = visible_mask(self.xp, self.pos_dev[:, None], self.k_pos[None, :], window)
                return self._memo[key]

            def advance(self, n_new):
                super().advance(n_new)
                if not self.static:
                    self.pos_dev[...] = self.pos
        return _DeviceCache


class MappedHost:
    """A small host array the GPU reads and writes in place (pinned, mapped: no copy call, so a captured CUDA graph
    reads the value the host wrote before each replay). .host: the NumPy view; .device: the same memory as a CuPy
    array (one address space: the host pointer is the device pointer)."""

    def __init__(self, cp, n, dtype):
        dtype = np.dtype(dtype)
        rt = cp.cuda.runtime
        self._rt, self._ptr = rt, rt.hostAlloc(n * dtype.itemsize, rt.hostAllocMapped)
        import ctypes
        self.host = np.ctypeslib.as_array((ctypes.c_byte * (n * dtype.itemsize)).from_address(self._ptr)).view(dtype)
        mem = cp.cuda.UnownedMemory(self._ptr, n * dtype.itemsize, self, device_id=cp.cuda.Device().id)
        self.device = cp.ndarray((n,), dtype=dtype, memptr=cp.cuda.MemoryPointer(mem, 0))

    def __del__(self):
        try:
            self._rt.freeHost(self._ptr)
        except Exception:        # interpreter shutdown: the driver frees it with the process
            pass


class GraphDecoder:
    """decode(token) -> logits [1, V] on the device. The first step runs eagerly (it also fills CuPy's memory
    pool with every buffer a step needs, so that capturing allocates nothing new); the second captures one
    whole decode step as a CUDA graph (with the argmax of its logits, which backend.argmax then reads instead of
    launching its own: plain greedy sampling costs no launch); later steps only write the token into mapped host
    memory and replay the graph, whose last kernel advances the device position. Nothing else allocates device
    memory between replays."""

    def __init__(self, engine, cache):
        self.engine, self.cache = engine, cache
        xp = engine.xp
        self.xp = xp
        try:          # the token the host writes and the step reads, and the steps' argmaxes, without copy calls
            self._tok, self._ring = MappedHost(xp, 1, np.int64), MappedHost(xp, RING, np.int64)
            self.tok = self._tok.device
        except Exception:                     # no mapped host memory here: a device array, filled each step
            self._tok, self._ring, self.tok = None, None, xp.zeros(1, dtype=xp.int64)
        self.graph, self.out, self.steps = None, None, 0
        self.stream = xp.cuda.Stream(non_blocking=True)
        self.use_graph = engine.backend.info.get("cuda_graphs", False)
        layers = [(_or(joined((lw.wq, lw.wk, lw.wv), xp), [lw.wq, lw.wk, lw.wv]), lw.wo,
                   joined((lw.w_gate, lw.w_up), xp), lw.w_down, lw.attn_norm, lw.ffn_norm) for lw in engine.weights.layers]
        self.fused = FusedStep.plan(engine, cache, layers)     # float16 or blocks llama weights: five kernels a layer
        self.chained = self._chained if settings().cuda_chain else None
        engine.backend.info["fused_decode"] = self.fused is not None

    def _step(self):
        """One step at the device-side position, which its last kernel advances (inside a captured graph too); the
        host position advances here (the replay path advances it itself: capture only records)."""
        c, ops = self.cache, self.engine.ops
        c.static = ops.static_decode = True
        try:
            if self.fused is not None:
                out = self.fused(self.tok)
                c.advance(1)                                # as forward's own advance for the op-by-op step
            else:
                out = self.engine.backend.forward(self.xp, self.engine.config, self.engine.weights, self.tok, c, ops)
        finally:
            c.static = ops.static_decode = False
        _kernels(self.xp)["bump_pos"]((1,), (1,), (c.pos_dev,))
        return out

    def __call__(self, token):
        xp, c = self.xp, self.cache
        c.check_room(1)
        with self.stream:
            if self._tok is not None:
                self._tok.host[0] = int(token)  # the previous step is over (synchronized below)
            else:
                self.tok[...] = int(token)
            self.steps += 1
            if not self.use_graph or self.steps == 1:
                out = self._step()
            else:
                if self.graph is None:
                    p0 = c.pos
                    try:
                        rt = xp.cuda.runtime
                        mode = getattr(rt, "streamCaptureModeRelaxed", None)
                        self.stream.begin_capture(*(() if mode is None else (mode,)))
                        self.out = self._step()
                        if self._ring is not None:  # the argmax greedy sampling asks for, in the same graph:
                            _kernels(xp)["argmax_feed"]((1,), (1024,), (self.out, np.int32(self.out.size),  # the
                                                        self.tok, self._ring.device, np.int32(RING), c.pos_dev))  # next
                            # step's input (chained reads it) and ring slot pos % RING
                        self.graph = self.stream.end_capture()
                    except Exception as e:   # capture unsupported here: run eagerly from now on
                        try:
                            self.stream.end_capture()
                        except Exception:
                            pass
                        self.engine.backend.info["cuda_graphs"] = False
                        self.engine.backend.info["cuda_graphs_error"] = f"{type(e).__name__}: {e}"[:200]
                        self.use_graph = False
                        c.pos = p0
                        self.steps -= 1
                        return self(token)
                    c.pos = p0               # capture only recorded the step; replay it now
                self.graph.launch(self.stream)
                c.pos += 1
                out = self.out
                if self._ring is not None:
                    self.engine.backend.step_argmax[out.data.ptr] = (out, self._ring, c.pos % RING)
        self.stream.synchronize()
        return out

    def _chained(self, first):
        """Plain greedy decoding from token `first` -> yields each next token, the steps chained on the device: a
        replayed step's argmax is the next step's input (argmax_feed), so one step is launched ahead of the token
        the host reads (the card never waits for the host between steps). The tokens are the unchained steps' (the
        same graph). cache.pos counts the steps whose token was read; closing the generator waits for the step
        ahead and sets the device position back to it (its K/V row past the sequence is never read).
        Before the graph is captured, or without a graph or mapped memory: the steps one at a time through
        __call__. Generation takes it as `chained` (None with settings' cuda_chain off: one step at a time)."""
        tok, c, s = int(first), self.cache, self.stream
        while self.graph is None or not self.use_graph or self._ring is None:
            tok = self.engine.backend.argmax(self(tok)[-1])         # the first eager step, the capture
            yield tok
        ahead = []                                                  # (event, ring slot) of steps launched, unread
        self._tok.host[0] = tok
        try:
            while True:
                while len(ahead) < 2 and c.pos + len(ahead) < c.n_ctx:
                    with s:
                        self.graph.launch(s)
                        done = self.xp.cuda.Event(disable_timing=True)
                        done.record(s)
                    ahead.append((done, (c.pos + len(ahead) + 1) % RING))
                if not ahead:
                    c.check_room(1)                                 # the context is full: its one-line error
                done, slot = ahead.pop(0)
                done.synchronize()
                c.pos += 1
                self.steps += 1
                yield int(self._ring.host[slot])
        finally:
            s.synchronize()
            with s:
                c.pos_dev[...] = c.pos                              # the step launched ahead, undone
            s.synchronize()


RING = 4            # ring slots of the steps' argmaxes (chained keeps at most two steps unread)


_KERNELS_SRC = cuda_source("kernels.cu")
_KERNELS = {}


def _kernels(cp):
    """The RawKernels above, compiled once per process."""
    if not _KERNELS:
        mod = cp.RawModule(code=_KERNELS_SRC, options=("-std=c++17",))
        for name in ("gemv_f32", "gemv_f16", "gemv_f32_row", "gemv_f16_v8", "gemv_f16_x4", "rms_norm_rows",
                     "rope_rows", "attend", "kv_store_f32", "kv_store_f16", "softmax_rows", "argmax_row", "argmax_feed",
                     "rope_store_f32", "rope_store_f16", "softmax_rows_f16", "rms_norm_rows_f16",
                     "add_rms_norm_f32", "add_rms_norm_f16", "glu_f32", "glu_f16", "bump_pos"):
            _KERNELS[name] = mod.get_function(name)
    return _KERNELS
