"""The cupy backend's layer functions: CudaOps, the model's ops (llorch_ref.model.layers) with the hot ones run by
kernels.cu and cuBLAS.

One-token products and the decode step's operations are written without cuBLAS so that a decode step can be captured
as a CUDA graph (CuPy refuses cuBLAS calls during capture): a warp-per-row GEMV, fused RMSNorm, RoPE, attention and
gated-activation kernels. Several-token products use cuBLAS. Where nobody watches (CupyBackend.forward sets
`unwatched`), prompts take tensor cores: float16 weights' attention in float16 products with the activations that
only feed float16 products carried in float16 (cuda_half); GGUF blocks as CudaOps.blocks_prompt says ("split":
weights and activations in two float16 parts each, float32's band; "float16": as float16 weights, with their
attention). A recorder sees the float32 products (blocks: dequantized as gguf-py does). settings' cuda_half_prefill
off: neither.
"""
from __future__ import annotations

from .cuda_blocks import GpuBlocks
from .cuda_half import half_attention, half_attention_core, half_gemm
from .cuda_source import cuda_source
from .fused_forward import Fusions
from .settings import settings

_KERNELS_SRC = cuda_source("kernels.cu")
_KERNELS = {}
KERNEL_NAMES = ("gemv_f32", "gemv_f16", "gemv_f32_row", "gemv_f16_v8", "gemv_f16_x4", "rms_norm_rows", "rope_rows",
                "attend", "kv_store_f32", "kv_store_f16", "softmax_rows", "argmax_row", "argmax_feed", "rope_store_f32",
                "rope_store_f16", "softmax_rows_f16", "rms_norm_rows_f16", "add_rms_norm_f32", "add_rms_norm_f16",
                "glu_f32", "glu_f16", "bump_pos")


def kernels(cp):
    """kernels.cu's RawKernels by name, compiled once per process."""
    if not _KERNELS:
        mod = cp.RawModule(code=_KERNELS_SRC, options=("-std=c++17",))
        for name in KERNEL_NAMES:
            _KERNELS[name] = mod.get_function(name)
    return _KERNELS


def joined(ws, cp):
    """Views of consecutive rows of one allocation (as CupyBackend.prepare_weights stacks them) -> one matrix over
    all their rows, or None."""
    w0 = ws[0]
    if isinstance(w0, GpuBlocks):
        if not all(isinstance(w, GpuBlocks) and (w.qtype, w.fmt) == (w0.qtype, w0.fmt) for w in ws):
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
    return GpuBlocks(w0.qtype, (rows, w0.shape[1]), whole, cp, w0.fmt) if isinstance(w0, GpuBlocks) else whole


class CudaOps:
    """The layer-function table of the cupy backend: every public name of base_ops, with the methods below in place
    of theirs. static_decode: True while GraphDecoder runs a step over the whole preallocated cache; unwatched: True
    while CupyBackend.forward runs (no recorder), which lets prompts take the float16 paths; fusions: the
    fused_forward.Fusions the backend's own forward uses; blocks_prompt: how a prompt nobody watches multiplies
    GGUF blocks (GpuBlocks.matmul's prompt: "split" by default, "float16" faster in float16's band)."""

    blocks_prompt = "split"

    def __init__(self, base_ops, cp, dtype):
        own = set(dir(type(self)))
        self.__dict__.update({n: getattr(base_ops, n) for n in dir(base_ops) if not n.startswith("_") and n not in own})
        self.base, self.cp, self.dtype = base_ops, cp, dtype
        self.K = kernels(cp)
        self.static_decode = self.unwatched = False
        self.half_prefill = settings().cuda_half_prefill
        self._kv_heads = {}
        self.fusions = Fusions(attention_out=self.attention_out, rope_store_attend=self.rope_store_attend,
                               add_norm=self.add_norm if settings().cuda_fused_norm else None)

    def half_rows(self, t: int, norm: bool = False) -> bool:
        """Whether t tokens' products and attention may round as float16 ones: several tokens, float16 weights
        (then the products are float16 watched or not) or blocks in float16 where nobody watches; cuda_half_prefill
        off, neither, except the float16 rows add_norm hands to float16 weights' products (norm)."""
        if t == 1:
            return False
        if self.dtype == "float16":
            return norm or self.half_prefill
        return self.dtype == "blocks" and self.unwatched and self.half_prefill and self.blocks_prompt == "float16"

    def dense(self, a):
        """a as a C-contiguous float32 array (itself when it is one: no call into CuPy)."""
        cp = self.cp
        return a if a.dtype == cp.float32 and a.flags.c_contiguous else cp.ascontiguousarray(a, dtype=cp.float32)

    def linear(self, xp, x, w):
        cp = self.cp
        if isinstance(w, GpuBlocks):
            fast = x.shape[0] > 1 and self.unwatched and self.half_prefill
            return w.matmul(x, self.blocks_prompt if fast else "float32")
        if x.shape[0] == 1 and w.ndim == 2:
            return self.gemv(x, w)
        if w.dtype == cp.float16:                         # float16 products, float32 results (cuBLAS)
            return half_gemm(cp, x, w) if self.half_prefill else (x.astype(cp.float16) @ w.T).astype(cp.float32)
        return x @ w.T

    def gemv(self, x, w):
        """x [1, K] times a float32 or float16 weight [N, K] -> [1, N] float32, without cuBLAS."""
        cp, i32 = self.cp, self.cp.int32
        y = cp.empty((1, w.shape[0]), dtype=cp.float32)
        n, kdim = w.shape
        half = w.dtype == cp.float16
        vec = (kdim % 8 == 0) if half else (kdim % 4 == 0)
        xv = cp.ascontiguousarray(x[0], dtype=cp.float32)
        if not half and vec:                              # float32 rows: a block of 128 threads per row
            self.K["gemv_f32_row"]((n,), (128,), (w, xv, y, i32(n), i32(kdim)))
        elif half and vec:                                # a warp per row, 4 loads of 16 bytes in flight
            self.K["gemv_f16_x4"](((n + 3) // 4,), (128,), (w, xv, y, i32(n), i32(kdim)))
        else:                                             # a warp per row
            self.K["gemv_f16" if half else "gemv_f32"](((n + 7) // 8,), (256,), (w, xv, y, i32(n), i32(kdim)))
        return y

    def rms_norm(self, xp, x, w, eps):
        cp = self.cp
        x = self.dense(x)
        y = cp.empty_like(x)
        n = w.shape[0]
        self.K["rms_norm_rows"]((x.size // n,), (256,), (x, w, y, cp.int32(n), cp.float32(eps)))
        return y

    def add_norm(self, xp, x, a, w, eps):
        """A residual add and the RMSNorm after it in one kernel (Fusions.add_norm, where nobody watches): -> (x + a,
        its RMSNorm), a None: (x, RMSNorm of x). The sum as x + a, the norm as rms_norm's, to the bit; the normed
        rows in float16 where several-token float16 products take them next (they round them so anyway)."""
        cp, i32, f32 = self.cp, self.cp.int32, self.cp.float32
        x = self.dense(x)
        n = w.shape[0]
        half = self.half_rows(x.shape[0], norm=True)
        y = cp.empty(x.shape, dtype=cp.float16 if half else f32)
        if a is None:
            self.K["rms_norm_rows_f16" if half else "rms_norm_rows"]((x.size // n,), (256,),
                                                                     (x, w, y, i32(n), f32(eps)))
            return x, y
        s = cp.empty_like(x)
        self.K["add_rms_norm_f16" if half else "add_rms_norm_f32"]((x.size // n,), (256,),
                                                                   (x, self.dense(a), s, w, y, i32(n), f32(eps)))
        return s, y

    def rope(self, xp, x, cos, sin, style):
        """x: [T, nh, Hd]; read in place when each token's heads are contiguous (a slice of the stacked Q/K/V
        product's rows), else copied first."""
        cp, i32, f32 = self.cp, self.cp.int32, self.cp.float32
        t, nh, hd, half = x.shape[0], x.shape[1], x.shape[2], cos.shape[-1]
        if not (x.dtype == f32 and x.strides[2] == 4 and x.strides[1] == 4 * hd and x.strides[0] % 4 == 0):
            x = cp.ascontiguousarray(x, dtype=f32)
        y = cp.empty((t, nh, hd), dtype=f32)
        total = t * nh * (hd - half)
        self.K["rope_rows"](((total + 255) // 256,), (256,),
                            (x, self.dense(cos), self.dense(sin), y, i32(t), i32(nh), i32(hd), i32(half),
                             i32(style == "neox"), cp.int64(x.strides[0] // 4)))
        return y

    def parts(self, x, ws):
        """The products with matrices stacked in one allocation by one GEMV (one token) or one cuBLAS product
        (several: one cast of x, one larger GEMM); matrices apart, each on its own."""
        whole = joined(ws, self.cp)
        if whole is None:
            return [self.linear(self.cp, x, w) for w in ws]
        y = self.linear(self.cp, x, whole)
        bounds = [0]
        for w in ws:
            bounds.append(bounds[-1] + w.shape[0])
        return [y[:, lo:hi] for lo, hi in zip(bounds[:-1], bounds[1:])]

    def qkv(self, xp, x, wq, wk, wv, h, kv, hd):
        t = x.shape[0]
        q, k, v = self.parts(x, (wq, wk, wv))
        return q.reshape(t, h, hd), k.reshape(t, kv, hd), v.reshape(t, kv, hd)

    def glu(self, x, w_gate, w_up, w_down, gelu):
        """The gated FFN, act(g) * u in one kernel read from the gate/up rows where they are; on float16 input
        (add_norm's, where nobody watches) the hidden rows come in float16 too, for the down product that
        would round them so."""
        cp, f32 = self.cp, self.cp.float32
        g, u = self.parts(x, (w_gate, w_up))
        if not (g.dtype == u.dtype == f32 and g.strides == u.strides and g.strides[1] == 4):
            g, u = self.dense(g), self.dense(u)
        t, nf = g.shape
        half = x.dtype == cp.float16
        h = cp.empty((t, nf), dtype=cp.float16 if half else f32)
        self.K["glu_f16" if half else "glu_f32"](((t * nf + 255) // 256,), (256,),
                                                 (g, u, cp.int64(g.strides[0] // 4), h, cp.int32(nf),
                                                  cp.int64(t * nf), cp.int32(gelu)))
        return self.linear(cp, h, w_down), h

    def swiglu(self, xp, x, w_gate, w_up, w_down):
        return self.glu(x, w_gate, w_up, w_down, False)

    def geglu(self, xp, x, w_gate, w_up, w_down):
        return self.glu(x, w_gate, w_up, w_down, True)

    def attention(self, xp, q, k, v, mask, scale, kv_head):
        """One token: one fused kernel per layer (scores, softmax, P.V), one block per head. Every forward the
        harness can record: kq holds every raw dot, as the reference's. A decode step over the whole preallocated
        cache (static_decode): masked keys are not read, and kq holds 0 there."""
        if q.shape[0] != 1:                 # several tokens: batched cuBLAS products and one softmax kernel
            return self.attention_rows(q, k, v, mask, scale, kv_head)
        cp, i32 = self.cp, self.cp.int32
        hd = q.shape[2]
        threads = 1024 if hd <= 1024 else 0
        smem = 4 * (k.shape[0] + (threads // max(hd, 1)) * hd)      # scores + partial sums (48 KB max)
        if not threads or smem > 48 * 1024:
            return self.base.attention(xp, q, k, v, mask, scale, kv_head)
        t, h = q.shape[0], q.shape[1]
        s_len, kv = k.shape[0], k.shape[1]
        kq = cp.empty((h, t, s_len), dtype=cp.float32)
        probs = cp.empty((h, t, s_len), dtype=cp.float32)
        out = cp.empty((t, h * hd), dtype=cp.float32)
        self.K["attend"]((h, t), (threads,),
                         (cp.ascontiguousarray(q, dtype=cp.float32), cp.ascontiguousarray(k), cp.ascontiguousarray(v),
                          cp.ascontiguousarray(mask, dtype=cp.float32), kq, probs, out, i32(t), i32(s_len), i32(h),
                          i32(kv), i32(hd), cp.float32(scale), i32(not self.static_decode)), shared_mem=smem)
        return out, kq, probs

    def attention_rows(self, q, k, v, mask, scale, kv_head):
        """The reference's attention for several tokens (layers.attention): q.k^T and P.V as batched cuBLAS
        products (K/V heads repeated only where there are fewer of them), the softmax of kq * scale + mask
        in one kernel (the same float32 operations, the sum in float64) instead of seven passes."""
        cp = self.cp
        t, h, hd = q.shape
        s_len, kv = k.shape[0], k.shape[1]
        kh = k if kv == h else k[:, kv_head, :]
        kq = cp.matmul(q.transpose(1, 0, 2), kh.transpose(1, 2, 0))                  # [H, T, S]
        probs = cp.empty_like(kq)
        self.K["softmax_rows"]((h * t,), (256,), (cp.ascontiguousarray(kq), cp.ascontiguousarray(mask, dtype=cp.float32),
                                                  probs, cp.float32(scale), cp.int32(s_len), cp.int32(t)))
        vh = (v if kv == h else v[:, kv_head, :]).transpose(1, 0, 2)                  # [H, S, Hd]
        return cp.matmul(probs, vh).transpose(1, 0, 2).reshape(t, -1), kq, probs

    def attention_out(self, xp, q, k, v, mask, scale, kv_head):
        """Several tokens that no recorder watches (the fused forward asks for the output only): on the float16
        paths (half_rows), Q.K and P.V as float16 cuBLAS products (kq and probs never recorded), the output in
        float16 for the output projection's float16 product; otherwise the recorded path's output."""
        if not self.half_rows(q.shape[0]):
            return self.attention(xp, q, k, v, mask, scale, kv_head)[0]
        return half_attention(self.cp, q, k, v, mask, scale, self.K["softmax_rows_f16"])

    def fits_rope_store(self, q, k, v, style, cache) -> bool:
        """Whether rope_store_attend takes these: several tokens on the float16 paths, a RoPE style it knows, the
        host-indexed cache in float32 or float16, q/k/v float32 views of one stacked Q/K/V product's rows."""
        cp, f32 = self.cp, self.cp.float32
        t, h, hd = q.shape
        kv, row = k.shape[1], q.strides[0]
        if not self.half_rows(t) or style not in ("adjacent", "neox") or getattr(cache, "static", False) \
                or q.dtype != f32 or cache.k.dtype not in (f32, cp.float16):
            return False
        return (k.strides[0] == v.strides[0] == row and q.strides[1:] == k.strides[1:] == v.strides[1:] == (4 * hd, 4)
                and k.data.ptr == q.data.ptr + 4 * h * hd and v.data.ptr == q.data.ptr + 4 * (h + kv) * hd)

    def rope_store_attend(self, xp, q, k, v, cos, sin, style, cache, layer, window, scale, kv_head):
        """Several tokens that no recorder watches, on the float16 paths, q/k/v straight from the stacked Q/K/V
        product: RoPE, the cache write and the float16 head-major copies in one kernel (rope_store), then the
        attention's batched products (cuda_half) -> the attention output [T, H*Hd] in float16; None where that
        does not apply (fused_forward.attend then runs the operations one by one)."""
        if not self.fits_rope_store(q, k, v, style, cache):
            return None
        cp, i32 = self.cp, self.cp.int32
        t, h, hd = q.shape
        kv = k.shape[1]
        pos, half = cache.pos, cos.shape[-1]
        s_len = pos + t
        q16 = cp.empty((h, t, hd), dtype=cp.float16)
        k16, v16 = cp.empty((kv, s_len, hd), dtype=cp.float16), cp.empty((kv, s_len, hd), dtype=cp.float16)
        if pos:                                         # the cached prefix, as float16 in head-major order
            k16[:, :pos] = cache.k[layer, :pos].transpose(1, 0, 2)
            v16[:, :pos] = cache.v[layer, :pos].transpose(1, 0, 2)
        n = t * (h + 2 * kv) * hd
        self.K["rope_store_f16" if cache.k.dtype == cp.float16 else "rope_store_f32"](
            ((n + 255) // 256,), (256,), (q, cp.int64(q.strides[0] // 4), self.dense(cos), self.dense(sin),
                                          cache.k[layer], cache.v[layer], q16, k16, v16, i32(t), i32(h), i32(kv),
                                          i32(hd), i32(half), i32(style == "neox"), i32(pos), i32(s_len)))
        return half_attention_core(cp, q16, k16, v16, cache.mask(t, window), scale, self.K["softmax_rows_f16"])

    def kv_head_of(self, xp, n_heads, n_kv_heads):
        """The same small index array for every layer."""
        key = (n_heads, n_kv_heads)
        if key not in self._kv_heads:
            self._kv_heads[key] = self.base.kv_head_of(xp, n_heads, n_kv_heads)
        return self._kv_heads[key]
