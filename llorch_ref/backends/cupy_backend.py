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
from .fused_forward import Fusions
from .fused_forward import forward as fused_forward


class CupyBackend(Backend):
    def __init__(self, dtype="float32"):
        os.environ.setdefault("CUPY_TF32", "0")
        os.environ.setdefault("CUPY_ACCELERATORS", "")     # plain reduction kernels: capturable in a CUDA graph
        import cupy

        dev = cupy.cuda.Device()
        props = cupy.cuda.runtime.getDeviceProperties(dev.id)
        graphs = os.environ.get("LLORCH_CUDA_GRAPHS", "1") != "0"
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
        # products (cuda_half); LLORCH_CUDA_HALF_PREFILL=0: CuPy's float16 matmul cast back, attention as recorded
        half_prefill = os.environ.get("LLORCH_CUDA_HALF_PREFILL", "1") != "0"

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
        fused_norm = os.environ.get("LLORCH_CUDA_FUSED_NORM", "1") != "0"   # =0: the adds and norms one by one
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
        self.chained = self._chained if os.environ.get("LLORCH_CUDA_CHAIN", "1") != "0" else None
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
        __call__. Generation takes it as `chained` (None with LLORCH_CUDA_CHAIN=0: one step at a time)."""
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


_KERNELS_SRC = r"""
#include <cuda_fp16.h>
// y[n] = sum_k W[n, k] x[k], float32 accumulation: one warp per row (scalar loads, or 8 halves at a time), or
// for float32 rows whose length is a multiple of 4, a block per row (gemv_f32_row).
template <typename T>
__device__ void gemv(const T* W, const float* x, float* y, int n, int k) {
    int row = blockIdx.x * 8 + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    if (row >= n) return;
    const T* w = W + (size_t)row * k;
    float acc = 0.f;
    for (int i = lane; i < k; i += 32) acc += (float)w[i] * x[i];
    for (int off = 16; off > 0; off >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, off);
    if (lane == 0) y[row] = acc;
}
extern "C" __global__ void gemv_f32(const float* W, const float* x, float* y, int n, int k) { gemv<float>(W, x, y, n, k); }
extern "C" __global__ void gemv_f16(const __half* W, const float* x, float* y, int n, int k) { gemv<__half>(W, x, y, n, k); }

extern "C" __global__ void gemv_f32_row(const float* __restrict__ W, const float* __restrict__ x,
                                        float* __restrict__ y, int n, int k) {   // k % 4 == 0; 128 threads a row
    int row = blockIdx.x, tid = threadIdx.x;
    const float4* w = reinterpret_cast<const float4*>(W + (size_t)row * k);
    const float4* xv = reinterpret_cast<const float4*>(x);
    float a[4] = {0.f, 0.f, 0.f, 0.f};
    int k4 = k / 4, i = tid;
    for (; i + 384 < k4; i += 512) {          // the block reads 8 KB of the row per step, 4 loads a thread
        float4 p[4], u[4];
#pragma unroll
        for (int r = 0; r < 4; ++r) { p[r] = __ldcs(w + i + 128 * r); u[r] = __ldg(xv + i + 128 * r); }
#pragma unroll
        for (int r = 0; r < 4; ++r) a[r] += p[r].x * u[r].x + p[r].y * u[r].y + p[r].z * u[r].z + p[r].w * u[r].w;
    }
    for (; i < k4; i += 128) { float4 p = __ldcs(w + i), u = __ldg(xv + i); a[0] += p.x * u.x + p.y * u.y + p.z * u.z + p.w * u.w; }
    float acc = (a[0] + a[1]) + (a[2] + a[3]);
    for (int off = 16; off > 0; off >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, off);
    __shared__ float part[4];
    if (tid % 32 == 0) part[tid / 32] = acc;
    __syncthreads();
    if (tid == 0) y[row] = (part[0] + part[1]) + (part[2] + part[3]);
}

extern "C" __global__ void gemv_f16_v8(const __half* __restrict__ W, const float* __restrict__ x,
                                       float* __restrict__ y, int n, int k) {  // k % 8 == 0
    int row = blockIdx.x * 8 + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    if (row >= n) return;
    const uint4* w = reinterpret_cast<const uint4*>(W + (size_t)row * k);
    const float4* xv = reinterpret_cast<const float4*>(x);
    float a[2] = {0.f, 0.f};
    int k8 = k / 8, i = lane;
    for (; i < k8; i += 64) {                 // two independent 16-byte weight loads in flight per lane
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            int c = i + 32 * r;
            if (c < k8) {
                uint4 raw = __ldcs(w + c);
                const __half2* h = reinterpret_cast<const __half2*>(&raw);
                float4 u = __ldg(xv + 2 * c), v = __ldg(xv + 2 * c + 1);
                float2 f0 = __half22float2(h[0]), f1 = __half22float2(h[1]), f2 = __half22float2(h[2]), f3 = __half22float2(h[3]);
                a[r] += f0.x * u.x + f0.y * u.y + f1.x * u.z + f1.y * u.w + f2.x * v.x + f2.y * v.y + f3.x * v.z + f3.y * v.w;
            }
        }
    }
    float acc = a[0] + a[1];
    for (int off = 16; off > 0; off >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, off);
    if (lane == 0) y[row] = acc;
}

// The same product with four 16-byte weight loads issued before any is used (more bytes in flight per
// lane), a warp per row, 4 rows a block of 128 threads.
extern "C" __global__ void gemv_f16_x4(const __half* __restrict__ W, const float* __restrict__ x,
                                       float* __restrict__ y, int n, int k) {  // k % 8 == 0
    int row = blockIdx.x * 4 + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    if (row >= n) return;
    const uint4* w = reinterpret_cast<const uint4*>(W + (size_t)row * k);
    const float4* xv = reinterpret_cast<const float4*>(x);
    float a[4] = {0.f, 0.f, 0.f, 0.f};
    int k8 = k / 8, i = lane;
    for (; i + 96 < k8; i += 128) {
        uint4 raw[4];
#pragma unroll
        for (int r = 0; r < 4; ++r) raw[r] = __ldcs(w + i + 32 * r);
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            int c = i + 32 * r;
            const __half2* h = reinterpret_cast<const __half2*>(&raw[r]);
            float4 u = __ldg(xv + 2 * c), v = __ldg(xv + 2 * c + 1);
            float2 f0 = __half22float2(h[0]), f1 = __half22float2(h[1]), f2 = __half22float2(h[2]), f3 = __half22float2(h[3]);
            a[r] += f0.x * u.x + f0.y * u.y + f1.x * u.z + f1.y * u.w + f2.x * v.x + f2.y * v.y + f3.x * v.z + f3.y * v.w;
        }
    }
    for (; i < k8; i += 32) {
        uint4 raw = __ldcs(w + i);
        const __half2* h = reinterpret_cast<const __half2*>(&raw);
        float4 u = __ldg(xv + 2 * i), v = __ldg(xv + 2 * i + 1);
        float2 f0 = __half22float2(h[0]), f1 = __half22float2(h[1]), f2 = __half22float2(h[2]), f3 = __half22float2(h[3]);
        a[0] += f0.x * u.x + f0.y * u.y + f1.x * u.z + f1.y * u.w + f2.x * v.x + f2.y * v.y + f3.x * v.z + f3.y * v.w;
    }
    float acc = (a[0] + a[1]) + (a[2] + a[3]);
    for (int off = 16; off > 0; off >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, off);
    if (lane == 0) y[row] = acc;
}

// An element stored as float32, or rounded to float16 (a float16 cache, or the input of a float16 product).
__device__ __forceinline__ void put(float* c, float v) { *c = v; }
__device__ __forceinline__ void put(__half* c, float v) { *c = __float2half_rn(v); }

// A decode step's K and V rows into the cache at the device-side position (one launch for both).
template <typename C> __device__ void kv_store(const float* k, const float* v, C* kc, C* vc, const long long* pos, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) { size_t at = (size_t)pos[0] * n + i; put(kc + at, k[i]); put(vc + at, v[i]); }
}
extern "C" __global__ void kv_store_f32(const float* k, const float* v, float* kc, float* vc, const long long* pos,
                                        int n) { kv_store(k, v, kc, vc, pos, n); }
extern "C" __global__ void kv_store_f16(const float* k, const float* v, __half* kc, __half* vc, const long long* pos,
                                        int n) { kv_store(k, v, kc, vc, pos, n); }

// out[0] = the index of the highest of x[0..n) as np.argmax answers: NaN above everything, the first index on ties
// (one block of 1024 threads: strided scans, then a tree of pairwise choices).
__device__ __forceinline__ bool ahead(float a, int ia, float b, int ib) {
    bool an = a != a, bn = b != b;
    if (an != bn) return an;
    if (!an && a != b) return a > b;
    return ia < ib;
}
__device__ __forceinline__ int argmax_block(const float* x, int n) {
    __shared__ float bv[1024];
    __shared__ int bi[1024];
    float v = __int_as_float(0xff800000);
    int iv = n;
    for (int i = threadIdx.x; i < n; i += blockDim.x) if (iv == n || ahead(x[i], i, v, iv)) { v = x[i]; iv = i; }
    bv[threadIdx.x] = v; bi[threadIdx.x] = iv;
    __syncthreads();
    for (int o = blockDim.x / 2; o > 0; o >>= 1) {
        if (threadIdx.x < o && bi[threadIdx.x + o] < n &&
            (bi[threadIdx.x] == n || ahead(bv[threadIdx.x + o], bi[threadIdx.x + o], bv[threadIdx.x], bi[threadIdx.x]))) {
            bv[threadIdx.x] = bv[threadIdx.x + o]; bi[threadIdx.x] = bi[threadIdx.x + o];
        }
        __syncthreads();
    }
    return bi[0];
}
extern "C" __global__ void argmax_row(const float* x, int n, long long* out) {
    int best = argmax_block(x, n);
    if (threadIdx.x == 0) out[0] = best;
}
// a decode step's argmax (after its position was advanced to pos): the next step's input token, and ring slot
// pos % ring for the host to read while a later step runs
extern "C" __global__ void argmax_feed(const float* x, int n, long long* tok, long long* ring, int ring_n,
                                       const long long* pos) {
    int best = argmax_block(x, n);
    if (threadIdx.x == 0) { tok[0] = best; ring[pos[0] % ring_n] = best; }
}

// softmax(kq * scale + mask) of each row of S scores (one block of 256 threads per row; row r of head r / T,
// token r % T): the reference's float32 operations, each rounded (no fused multiply-add), max, expf, the sum in
// float64, then e * (float)(1 / sum) (e computed again, the same expf, rather than stored and read back).
__device__ __forceinline__ float softmax_e(const float* row, const float* mk, int j, float scale, float m) {
    return expf(__fsub_rn(__fadd_rn(__fmul_rn(row[j], scale), mk[j]), m));
}
template <typename O>
__device__ void softmax_row(const float* kq, const float* mask, O* probs, float scale, int S, int T) {
    __shared__ float redf[256];
    __shared__ double redd[256];
    const float* row = kq + (size_t)blockIdx.x * S;
    const float* mk = mask + (size_t)(blockIdx.x % T) * S;
    O* out = probs + (size_t)blockIdx.x * S;
    float m = __int_as_float(0xff800000);
    for (int j = threadIdx.x; j < S; j += blockDim.x) m = fmaxf(m, __fadd_rn(__fmul_rn(row[j], scale), mk[j]));
    redf[threadIdx.x] = m;
    __syncthreads();
    for (int o = blockDim.x / 2; o > 0; o >>= 1) {
        if (threadIdx.x < o) redf[threadIdx.x] = fmaxf(redf[threadIdx.x], redf[threadIdx.x + o]);
        __syncthreads();
    }
    m = redf[0];
    double z = 0.0;
    for (int j = threadIdx.x; j < S; j += blockDim.x) z += (double)softmax_e(row, mk, j, scale, m);
    redd[threadIdx.x] = z;
    __syncthreads();
    for (int o = blockDim.x / 2; o > 0; o >>= 1) {
        if (threadIdx.x < o) redd[threadIdx.x] += redd[threadIdx.x + o];
        __syncthreads();
    }
    float inv = (float)(1.0 / redd[0]);
    for (int j = threadIdx.x; j < S; j += blockDim.x) put(out + j, __fmul_rn(softmax_e(row, mk, j, scale, m), inv));
}
extern "C" __global__ void softmax_rows(const float* kq, const float* mask, float* probs, float scale, int S, int T) {
    softmax_row(kq, mask, probs, scale, S, T);
}
extern "C" __global__ void softmax_rows_f16(const float* kq, const float* mask, __half* probs, float scale, int S,
                                            int T) {
    softmax_row(kq, mask, probs, scale, S, T);
}

// RMSNorm of each row of n values (one block of 256 threads per row): sum of squares in float64 as the NumPy
// reference, mean and root in float32, y = (x * (1 / sqrt(mean + eps))) * w. With a (add_rms_norm_*): the row is
// s = x + a (float32, written out: the residual stream) and y its RMSNorm, one pass for the two operations.
template <typename O>
__device__ void norm_row(const float* x, const float* a, float* s, const float* w, O* y, int n, float eps) {
    __shared__ double part[256];
    size_t at = (size_t)blockIdx.x * n;
    const float* xr = (a ? s : x) + at;                     // the normed row (s once written)
    double acc = 0.0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        float v = x[at + i];
        if (a) { v = __fadd_rn(v, a[at + i]); s[at + i] = v; }
        acc += (double)(v * v);
    }
    part[threadIdx.x] = acc;
    __syncthreads();
    for (int off = blockDim.x / 2; off > 0; off >>= 1) {
        if (threadIdx.x < off) part[threadIdx.x] += part[threadIdx.x + off];
        __syncthreads();
    }
    float mean = (float)(part[0] / n);
    float scale = 1.0f / sqrtf(mean + eps);
    for (int i = threadIdx.x; i < n; i += blockDim.x) put(y + at + i, (xr[i] * scale) * w[i]);   // own writes
}
extern "C" __global__ void rms_norm_rows(const float* x, const float* w, float* y, int n, float eps) {
    norm_row(x, (const float*)0, (float*)0, w, y, n, eps);
}
extern "C" __global__ void rms_norm_rows_f16(const float* x, const float* w, __half* y, int n, float eps) {
    norm_row(x, (const float*)0, (float*)0, w, y, n, eps);
}
extern "C" __global__ void add_rms_norm_f32(const float* x, const float* a, float* s, const float* w, float* y, int n,
                                            float eps) {
    norm_row(x, a, s, w, y, n, eps);
}
extern "C" __global__ void add_rms_norm_f16(const float* x, const float* a, float* s, const float* w, __half* y, int n,
                                            float eps) {
    norm_row(x, a, s, w, y, n, eps);
}

// The gated activations: g and u [T, F] rows ld floats apart (the two halves of the stacked gate/up product, or two
// arrays), h [T, F] = act(g) * u in float32 (silu, or gelu's tanh form), stored as float32 (glu_f32) or rounded to
// float16 for the down product that would round it so (glu_f16). One thread per element, grid-stride.
template <typename O>
__device__ void glu(const float* g, const float* u, long long ld, O* h, int F, long long n, int gelu) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        long long at = (i / F) * ld + i % F;
        float gv = g[at], uv = u[at];
        float a = gelu ? (0.5f * gv * (1.0f + tanhf(0.7978845608028654f * (gv + 0.044715f * gv * gv * gv))))
                       : (gv / (1.0f + expf(-gv)));
        put(h + i, a * uv);
    }
}
extern "C" __global__ void glu_f32(const float* g, const float* u, long long ld, float* h, int F, long long n,
                                   int gelu) {
    glu(g, u, ld, h, F, n, gelu);
}
extern "C" __global__ void glu_f16(const float* g, const float* u, long long ld, __half* h, int F, long long n,
                                   int gelu) {
    glu(g, u, ld, h, F, n, gelu);
}

// The device-side position a decode step read, advanced by the step's last kernel (inside its CUDA graph).
extern "C" __global__ void bump_pos(long long* pos) { pos[0] += 1; }

// A pair's rotation, each product and difference rounded as NumPy rounds them (no contraction into an FMA):
// y0 = x0 c - x1 s, y1 = x0 s + x1 c.
__device__ __forceinline__ float rot0(float x0, float x1, float c, float s) { return __fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, s)); }
__device__ __forceinline__ float rot1(float x0, float x1, float c, float s) { return __fadd_rn(__fmul_rn(x0, s), __fmul_rn(x1, c)); }

// RoPE: x [T, nh, hd], cos/sin [T, half] (half = rotated dims / 2); neox: pairs (i, i + half),
// adjacent: pairs (2i, 2i + 1); dims past 2 * half are copied. One thread per pair or copied dim.
extern "C" __global__ void rope_rows(const float* x, const float* cs, const float* sn, float* y, int T, int nh,
                                     int hd, int half, int neox, long long stride) {
    long idx = (long)blockIdx.x * blockDim.x + threadIdx.x;
    int per = hd - half;                                   // pairs + copied dims per head
    if (idx >= (long)T * nh * per) return;
    int t = idx / (nh * per), rem = idx % (nh * per);
    int h = rem / per, i = rem % per;
    const float* xh = x + (size_t)t * stride + (size_t)h * hd;     // token rows `stride` floats apart
    float* yh = y + ((size_t)t * nh + h) * hd;
    if (i < half) {
        int a = neox ? i : 2 * i, b = neox ? i + half : 2 * i + 1;
        float x0 = xh[a], x1 = xh[b], c = cs[t * half + i], s = sn[t * half + i];
        yh[a] = rot0(x0, x1, c, s);
        yh[b] = rot1(x0, x1, c, s);
    } else {
        int d = 2 * half + (i - half);
        yh[d] = xh[d];
    }
}

// Generation's prefill (no recorder watching): RoPE of the T new tokens' q and k read straight from the stacked
// Q/K/V product y (token rows ys floats apart: q at 0, k at H hd, v at (H + KV) hd), k and v written into this
// layer's cache rows pos.. (type C), and q, k, v as float16 in head-major order for the attention's batched
// products: q16 [H, T, hd], k16, v16 [KV, S, hd] at rows pos... The rotation is rope_rows's to the bit. One thread
// per (token, head of q, k or v, dim).
template <typename C>
__device__ void rope_store(const float* y, long long ys, const float* cs, const float* sn, C* kc, C* vc, __half* q16,
                           __half* k16, __half* v16, int T, int H, int KV, int hd, int half, int neox, int pos, int S) {
    long idx = (long)blockIdx.x * blockDim.x + threadIdx.x;
    int heads = H + 2 * KV;
    if (idx >= (long)T * heads * hd) return;
    int t = idx / (heads * hd), rem = idx % (heads * hd), hh = rem / hd, d = rem % hd;
    const float* xh = y + (size_t)t * ys + (size_t)hh * hd;
    float val = xh[d];
    if (hh < H + KV && d < 2 * half) {                       // q or k, a rotated dim: its pair's formula
        int i = neox ? (d < half ? d : d - half) : d / 2;
        bool first = neox ? d < half : d % 2 == 0;
        int a = neox ? i : 2 * i, b = neox ? i + half : 2 * i + 1;
        float c = cs[t * half + i], s = sn[t * half + i];
        val = first ? rot0(xh[a], xh[b], c, s) : rot1(xh[a], xh[b], c, s);
    }
    if (hh < H) { q16[((size_t)hh * T + t) * hd + d] = __float2half_rn(val); return; }
    bool is_k = hh < H + KV;
    int kvh = is_k ? hh - H : hh - H - KV;
    put((is_k ? kc : vc) + ((size_t)(pos + t) * KV + kvh) * hd + d, val);
    (is_k ? k16 : v16)[((size_t)kvh * S + pos + t) * hd + d] = __float2half_rn(val);
}
extern "C" __global__ void rope_store_f32(const float* y, long long ys, const float* cs, const float* sn, float* kc,
                                          float* vc, __half* q16, __half* k16, __half* v16, int T, int H, int KV,
                                          int hd, int half, int neox, int pos, int S) {
    rope_store(y, ys, cs, sn, kc, vc, q16, k16, v16, T, H, KV, hd, half, neox, pos, S);
}
extern "C" __global__ void rope_store_f16(const float* y, long long ys, const float* cs, const float* sn, __half* kc,
                                          __half* vc, __half* q16, __half* k16, __half* v16, int T, int H, int KV,
                                          int hd, int half, int neox, int pos, int S) {
    rope_store(y, ys, cs, sn, kc, vc, q16, k16, v16, T, H, KV, hd, half, neox, pos, S);
}

// Attention, one block of 1024 threads per (query head, query token). q [T, H, hd]; k, v [S, KV, hd];
// mask [T, S] (0 or -inf). Writes kq [H, T, S] (raw q.k everywhere with all_dots, else 0 where masked: masked
// keys are then not read),
// probs [H, T, S] (softmax of kq * scale + mask: max, exp in float32, sum in float64 as the reference) and
// out [T, H * hd].
// The mask is staged in shared memory first, so masked positions cost no global load; P.V is split over
// groups of threads (hd threads each) and the groups' sums added in a fixed order.
extern "C" __global__ void attend(const float* q, const float* k, const float* v, const float* mask,
                                  float* kq, float* probs, float* out, int T, int S, int H, int KV, int hd,
                                  float scale, int all_dots) {
    extern __shared__ float p[];                 // [S] scores, then probabilities; then [groups * hd] partials
    __shared__ float red[32];
    __shared__ double redd[32];
    const float NEG_INF = __int_as_float(0xff800000);
    int h = blockIdx.x, t = blockIdx.y, kvh = h / (H / KV);
    int nw = blockDim.x / 32, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const float* qh = q + ((size_t)t * H + h) * hd;
    mask += (size_t)t * S;
    kq += ((size_t)h * T + t) * S;
    probs += ((size_t)h * T + t) * S;
    out += ((size_t)t * H + h) * hd;
    __shared__ int seen_end;                     // 1 + the last visible position: nothing past it is read
    if (threadIdx.x == 0) seen_end = 0;
    for (int j = threadIdx.x; j < S; j += blockDim.x) p[j] = mask[j];
    __syncthreads();
    int my_end = 0;
    for (int j = threadIdx.x; j < S; j += blockDim.x) if (p[j] == 0.f) my_end = j + 1;
    atomicMax(&seen_end, my_end);
    __syncthreads();
    const int L = all_dots ? S : seen_end;       // a decode step over a long preallocated cache stops at L
    for (int j = L + threadIdx.x; j < S; j += blockDim.x) { kq[j] = 0.f; probs[j] = 0.f; }
    for (int j = warp; j < L; j += nw) {         // one warp per key position: coalesced rows
        float acc = 0.f;
        bool seen = p[j] == 0.f;
        if (seen || all_dots) {
            const float* kj = k + ((size_t)j * KV + kvh) * hd;
            for (int d = lane; d < hd; d += 32) acc += qh[d] * kj[d];
            for (int off = 16; off > 0; off >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, off);
        }
        if (lane == 0) {
            kq[j] = acc;
            p[j] = seen ? acc * scale : NEG_INF;
        }
    }
    __syncthreads();
    float m = NEG_INF;
    for (int j = threadIdx.x; j < L; j += blockDim.x) m = fmaxf(m, p[j]);
    for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_down_sync(0xffffffffu, m, off));
    if (lane == 0) red[warp] = m;
    __syncthreads();
    m = red[0];
    for (int w = 1; w < nw; ++w) m = fmaxf(m, red[w]);
    double z = 0.0;
    for (int j = threadIdx.x; j < L; j += blockDim.x) { float e = expf(p[j] - m); p[j] = e; z += (double)e; }
    for (int off = 16; off > 0; off >>= 1) z += __shfl_down_sync(0xffffffffu, z, off);
    if (lane == 0) redd[warp] = z;
    __syncthreads();
    z = 0.0;
    for (int w = 0; w < nw; ++w) z += redd[w];
    float inv = (float)(1.0 / z);
    for (int j = threadIdx.x; j < L; j += blockDim.x) { p[j] = p[j] * inv; probs[j] = p[j]; }
    __syncthreads();
    float* part = p + S;                         // [groups, hd]
    int groups = blockDim.x / hd;
    int g = threadIdx.x / hd, d = threadIdx.x % hd;
    if (g < groups) {
        float acc = 0.f;
        for (int j = g; j < L; j += groups)
            if (p[j] != 0.f) acc += p[j] * v[((size_t)j * KV + kvh) * hd + d];
        part[g * hd + d] = acc;
    }
    __syncthreads();
    for (int dd = threadIdx.x; dd < hd; dd += blockDim.x) {
        float acc = 0.f;
        for (int gg = 0; gg < groups; ++gg) acc += part[gg * hd + dd];
        out[dd] = acc;
    }
}
"""
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
