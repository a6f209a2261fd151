"""float16 products with float32 results through cuBLAS, for the cupy backend's several-token steps on float16
weights: cublasGemmEx / cublasGemmStridedBatchedEx with float16 inputs, float32 accumulation and a float32 output
(CuPy's own matmul would round the output to float16 and need a cast pass after it).

half_gemm:       y = x W^T for activations x [T, K] (cast to float16) and a float16 weight W [N, K]
split_gemm:      y = x W^T with x and W each split into a float16 high part and a scaled low part (float32's band
                 from tensor cores: the cupy backend's prompts on GGUF blocks)
half_attention:  one layer's attention of T new tokens, output only (generation's prefill: no recorder watches):
                 Q.K^T of each KV head's group of query heads in one batched product (Q, K in float16, scores in
                 float32, times the scale), the softmax kernel over the scores plus the mask (float32, the sum in
                 float64, the probabilities rounded to float16), P.V as a second batched product (P, V in float16,
                 float32 accumulation, the output rounded to float16: the output projection's input, which its
                 float16 product would round so). Without grouped heads the product writes the [T, H*Hd] rows in
                 place; with them, its head-major result is transposed after.

Row-major products through column-major cuBLAS: Y [T, N] = X [T, K] W^T is, column-major, Y^T = op(W) X with
W read as the K x N matrix it is column-major (transposed), X as K x T (not transposed).
"""
from __future__ import annotations

import numpy as np

_ONE, _ZERO = np.ones(1, np.float32), np.zeros(1, np.float32)        # host scalars cuBLAS reads (pointer mode host)
_ALPHA = {}                                                             # more of them, one array per value


def _cublas(cp):
    from cupy_backends.cuda.libs import cublas

    handle = cp.cuda.device.get_cublas_handle()
    cublas.setStream(handle, cp.cuda.get_current_stream().ptr)
    return cublas, handle


def half_gemm(cp, x, w):
    """x: [T, K] (any float), w: [N, K] float16 C-contiguous -> [T, N] float32."""
    cublas, handle = _cublas(cp)
    t, k = x.shape
    n = w.shape[0]
    x16 = x if x.dtype == cp.float16 and x.flags.c_contiguous else cp.ascontiguousarray(x, dtype=cp.float16)
    w = w if w.flags.c_contiguous else cp.ascontiguousarray(w)
    y = cp.empty((t, n), dtype=cp.float32)
    r16, r32 = cp.cuda.runtime.CUDA_R_16F, cp.cuda.runtime.CUDA_R_32F
    cublas.gemmEx(handle, cublas.CUBLAS_OP_T, cublas.CUBLAS_OP_N, n, t, k, _ONE.ctypes.data, w.data.ptr, r16, k,
                  x16.data.ptr, r16, k, _ZERO.ctypes.data, y.data.ptr, r32, n, cublas.CUBLAS_COMPUTE_32F,
                  cublas.CUBLAS_GEMM_DEFAULT)
    return y


def _gemm(cp, w, x, y, n, t, k, ldw, ldx, alpha, beta):
    """y [T, N] float32 (ld N) = alpha * x w^T + beta * y for float16 w (k columns read of each row, ld ldw) and x
    (ld ldx), through column-major cublasGemmEx (float32 accumulation); w, x: device pointers."""
    cublas, handle = _cublas(cp)
    r16, r32 = cp.cuda.runtime.CUDA_R_16F, cp.cuda.runtime.CUDA_R_32F
    al = _ALPHA.get(alpha)
    if al is None:
        al = _ALPHA.setdefault(alpha, np.full(1, alpha, np.float32))
    cublas.gemmEx(handle, cublas.CUBLAS_OP_T, cublas.CUBLAS_OP_N, n, t, k, al.ctypes.data, w, r16, ldw, x, r16, ldx,
                  (_ONE if beta else _ZERO).ctypes.data, y.data.ptr, r32, n, cublas.CUBLAS_COMPUTE_32F,
                  cublas.CUBLAS_GEMM_DEFAULT)


LO_SCALE = 2048.0          # the low parts of split products are stored times 2^11 (away from float16's subnormals)


def split_x(cp, x):
    """x [T, K] -> [T, 2K] float16: [lo | hi], hi = fp16(x), lo = fp16((x - hi) * 2^11)."""
    x = x if x.dtype == cp.float32 and x.flags.c_contiguous else cp.ascontiguousarray(x, dtype=cp.float32)
    t, k = x.shape
    hi = x.astype(cp.float16)
    out = cp.empty((t, 2 * k), dtype=cp.float16)
    out[:, k:] = hi
    out[:, :k] = (x - hi.astype(cp.float32)) * cp.float32(LO_SCALE)
    return out


def split_gemm(cp, x, w2):
    """x: [T, K] (any float) times a weight given as its split float16 parts w2 [N, 2K] = [hi | lo] (w = hi + lo *
    2^-11) -> [T, N] float32: x_hi w_hi^T + 2^-11 (x_lo w_hi^T + x_hi w_lo^T) in two tensor-core products (three times
    the float16 work), which leaves out x_lo w_lo^T (2^-22 relative): float32's band from float16 products."""
    t, k2 = x.shape[0], w2.shape[1]
    k, n = k2 // 2, w2.shape[0]
    x2 = split_x(cp, x)                                                  # [lo | hi]
    y = cp.empty((t, n), dtype=cp.float32)
    _gemm(cp, w2.data.ptr, x2.data.ptr + 2 * k, y, n, t, k, k2, k2, 1.0, False)           # hi . hi
    _gemm(cp, w2.data.ptr, x2.data.ptr, y, n, t, k2, k2, k2, 1.0 / LO_SCALE, True)       # [lo|hi] . [hi|lo]
    return y


def _batched(cp, a, b, c, m, n, k, lda, ldb, ldc, sa, sb, sc, batch, trans_a, alpha):
    """float16 a, b; c float32 or float16 (float32 accumulation either way)."""
    cublas, handle = _cublas(cp)
    r16, r32 = cp.cuda.runtime.CUDA_R_16F, cp.cuda.runtime.CUDA_R_32F
    rc = r16 if c.dtype == cp.float16 else r32
    al = _ALPHA.get(alpha)
    if al is None:
        al = _ALPHA.setdefault(alpha, np.full(1, alpha, np.float32))
    cublas.gemmStridedBatchedEx(handle, cublas.CUBLAS_OP_T if trans_a else cublas.CUBLAS_OP_N, cublas.CUBLAS_OP_N,
                                m, n, k, al.ctypes.data, a.data.ptr, r16, lda, sa, b.data.ptr, r16, ldb, sb,
                                _ZERO.ctypes.data, c.data.ptr, rc, ldc, sc, batch, cublas.CUBLAS_COMPUTE_32F,
                                cublas.CUBLAS_GEMM_DEFAULT)


def half_attention(cp, q, k, v, mask, scale, softmax_rows):
    """q: [T, H, Hd], k, v: [S, KV, Hd] (float32 or float16), mask: [T, S] float32 -> [T, H*Hd] float16.
    Query head h reads KV head h // (H / KV) (grouped heads are consecutive, so each KV head's group is one
    [group*T, Hd] block of the head-major Q). softmax_rows: the cupy backend's kernel softmax(kq * scale + mask) with
    float16 probabilities (softmax_rows_f16)."""
    q16 = cp.ascontiguousarray(q.transpose(1, 0, 2), dtype=cp.float16)            # [H, T, Hd] = [KV, g*T, Hd]
    k16 = cp.ascontiguousarray(k.transpose(1, 0, 2), dtype=cp.float16)            # [KV, S, Hd]
    v16 = cp.ascontiguousarray(v.transpose(1, 0, 2), dtype=cp.float16)
    return half_attention_core(cp, q16, k16, v16, mask, scale, softmax_rows)


def half_attention_core(cp, q16, k16, v16, mask, scale, softmax_rows):
    """half_attention on float16 head-major copies: q16 [H, T, Hd], k16, v16 [KV, S, Hd] -> [T, H*Hd] float16."""
    h, t, hd = q16.shape
    kv, s = k16.shape[0], k16.shape[1]
    g = h // kv
    kq = cp.empty((h, t, s), dtype=cp.float32)                                     # = [KV, g*T, S]
    # kq[b] (g*T x S) = q[b] k[b]^T * scale: column-major kq^T (S x gT) = op_T(k as Hd x S) q (Hd x gT)
    _batched(cp, k16, q16, kq, s, g * t, hd, hd, hd, s, s * hd, g * t * hd, g * t * s, kv, True, scale)
    p16 = cp.empty((h, t, s), dtype=cp.float16)
    mask = mask if mask.dtype == cp.float32 and mask.flags.c_contiguous else cp.ascontiguousarray(mask, cp.float32)
    softmax_rows((h * t,), (256,), (kq, mask, p16, np.float32(1.0), np.int32(s), np.int32(t)))
    # out[b] (gT x Hd) = p[b] (gT x S) v[b] (S x Hd): column-major out^T (Hd x gT) = v (Hd x S) p (S x gT); one query
    # head a KV head (g = 1): column t of batch b is row t's head b, written in place (ldc H*Hd, batches Hd apart)
    if g == 1:
        out = cp.empty((t, h * hd), dtype=cp.float16)
        _batched(cp, v16, p16, out, hd, t, s, hd, s, h * hd, s * hd, t * s, hd, kv, False, 1.0)
        return out
    out = cp.empty((h, t, hd), dtype=cp.float16)                                   # = [KV, g*T, Hd]
    _batched(cp, v16, p16, out, hd, g * t, s, hd, s, hd, s * hd, g * t * s, g * t * hd, kv, False, 1.0)
    return out.transpose(1, 0, 2).reshape(t, h * hd)
