"""ggml's CPU matrix products, reproduced in NumPy (x86, AVX2 build of llama.cpp with llamafile sgemm).

What llama.cpp computes for y = x @ W^T on the CPU, and what this module reproduces:

- Activations are converted to the weight's `vec_dot_type` first: Q8_0 for Q4_0/Q5_0/Q8_0 weights,
  Q8_1 for Q4_1/Q5_1, float16 for F16 weights, unchanged for F32. Q8 quantization per block of 32:
  d = amax/127 (stored as f16), q = round-half-even(x * 127/amax) (AVX `_mm256_round_ps`), and for Q8_1
  s = d * sum(q) (stored as f16).
- Each output is one dot product with 8 float32 lanes: per 32-element block, lane l holds the exact
  integer sum of elements 4l..4l+3 (for float types: element k goes to lane k % 8 of an 8-wide FMA
  accumulator), accumulated with fused multiply-add `acc = fma(d_w * d_x, lane_sum, acc)` block after
  block; then the lanes are summed as ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7)). Q4_1/Q5_1 add
  sum_b m_w * s_x, accumulated in float32, at the end.

FMA is emulated in float64 (a*b of two float32 values is exact in float64; the sum is rounded to float32).
All results are float32. Verified bit for bit against llama.cpp's captured tensors for Q4_1 and Q8_0
(tests/test_ggml_numerics.py).
"""
from __future__ import annotations

import numpy as np

F32, F64, F16 = np.float32, np.float64, np.float16
QK = 32


def hsum8(acc):
    """acc: [..., 8] f32 -> [...] f32, in the order of ggml's hsum_float_8 / tinyBLAS hsum."""
    r = acc[..., 4:] + acc[..., :4]                 # [..., 4]: lane i + lane i+4
    r = r[..., :2] + r[..., 2:]                     # [..., 2]: (0+2), (1+3)
    return r[..., 0] + r[..., 1]


def fma(a, b, c):
    """float32 fused multiply-add, emulated in float64."""
    return (a.astype(F64) * b.astype(F64) + c).astype(F32)


# -- activation quantization ------------------------------------------------------------------------
def quantize_q8(x, with_sum: bool):
    """x: [T, K] f32 -> q [T, B, 32] int8-valued f32, d [T, B] f32 (from f16), s [T, B] f32 (from f16) or None."""
    t, k = x.shape
    if k % QK:
        raise ValueError(f"row length {k} is not a multiple of {QK}")
    xb = x.reshape(t, k // QK, QK).astype(F32)
    amax = np.abs(xb).max(axis=-1)                                   # [T, B]
    d = amax / F32(127)                                              # f32
    with np.errstate(divide="ignore"):
        inv = np.where(amax != 0, F32(127) / amax, F32(0)).astype(F32)
    q = np.rint(xb * inv[..., None]).astype(F32)                     # round half to even, like _MM_ROUND_NEAREST
    d16 = d.astype(F16).astype(F32)
    s16 = (d * q.sum(axis=-1, dtype=F32)).astype(F16).astype(F32) if with_sum else None
    return q, d16, s16


# -- weight blocks ------------------------------------------------------------------------------------
def _f16(raw, lo):
    return np.ascontiguousarray(raw[..., lo:lo + 2]).view(F16)[..., 0].astype(F32)


def _nibbles(qs):
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.int16)        # natural element order


def _high_bits(qh_bytes):
    qh = np.ascontiguousarray(qh_bytes).view(np.uint32)[..., 0]
    return ((qh[..., None] >> np.arange(32, dtype=np.uint32)) & 1).astype(np.int16)


def unpack_blocks(raw, qtype: str):
    """raw: [N, B*bytes_per_block] uint8 -> (q [N, B, 32] int16 values, d [N, B] f32, m [N, B] f32 or None)."""
    sizes = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q8_0": 34}
    if qtype not in sizes:
        raise NotImplementedError(qtype)
    n = raw.shape[0]
    blk = np.asarray(raw).reshape(n, -1, sizes[qtype])
    if qtype == "Q4_0":
        return _nibbles(blk[..., 2:18]) - 8, _f16(blk, 0), None
    if qtype == "Q4_1":
        return _nibbles(blk[..., 4:20]), _f16(blk, 0), _f16(blk, 2)
    if qtype == "Q5_0":
        return _nibbles(blk[..., 6:22]) + (_high_bits(blk[..., 2:6]) << 4) - 16, _f16(blk, 0), None
    if qtype == "Q5_1":
        return _nibbles(blk[..., 8:24]) + (_high_bits(blk[..., 4:8]) << 4), _f16(blk, 0), _f16(blk, 2)
    return blk[..., 2:34].view(np.int8).astype(np.int16), _f16(blk, 0), None


ACT_TYPE = {"Q4_0": "Q8_0", "Q5_0": "Q8_0", "Q8_0": "Q8_0", "Q4_1": "Q8_1", "Q5_1": "Q8_1"}


class QuantMatrix:
    """A quantized weight [N, K] kept as ggml blocks; matmul(x) reproduces ggml's CPU product."""

    def __init__(self, raw, qtype: str, shape):
        self.qtype, self.shape = qtype, tuple(shape)
        q, d, m = unpack_blocks(raw, qtype)
        n, b, _ = q.shape
        # [B, 8, 4, N]: per block and lane, the 4 weights of that lane, ready for batched matmuls
        self.q_lanes = np.ascontiguousarray(q.reshape(n, b, 8, 4).transpose(1, 2, 3, 0).astype(F32))
        self.d, self.m = d, m                                            # [N, B] f32

    @property
    def dtype(self):
        return np.dtype(F32)

    def matmul(self, x, rows_per_chunk=64):
        """x: [T, K] f32 -> [T, N] f32."""
        out = np.empty((x.shape[0], self.shape[0]), dtype=F32)
        for i in range(0, x.shape[0], rows_per_chunk):
            out[i:i + rows_per_chunk] = self._matmul(x[i:i + rows_per_chunk])
        return out

    def _matmul(self, x):
        qa, da, sa = quantize_q8(x, with_sum=ACT_TYPE[self.qtype] == "Q8_1")
        t, b, _ = qa.shape
        n = self.shape[0]
        qa_lanes = qa.reshape(t, b, 8, 4).transpose(1, 2, 0, 3)                   # [B, 8, T, 4]
        acc = np.zeros((t, n, 8), dtype=F32)
        summs = np.zeros((t, n), dtype=F32) if self.m is not None else None
        for blk in range(b):
            lane = np.matmul(qa_lanes[blk], self.q_lanes[blk])                    # [8, T, N] exact integers
            d0d1 = self.d[None, :, blk] * da[:, blk, None]                         # [T, N] f32
            acc = fma(d0d1[..., None], lane.transpose(1, 2, 0), acc)
            if summs is not None:
                summs = summs + self.m[None, :, blk] * sa[:, blk, None]            # f32
        y = hsum8(acc)
        return y + summs if summs is not None else y


class FloatMatrix:
    """An F32 or F16 weight [N, K]; matmul(x) reproduces llamafile's tinyBLAS product (8-lane FMA over K)."""

    def __init__(self, w, qtype: str):
        self.qtype, self.shape = qtype, w.shape
        self.w = np.asarray(w, dtype=F32)                                # F16 values are exact in f32

    @property
    def dtype(self):
        return np.dtype(F32)

    def matmul(self, x, rows_per_chunk=16):
        x = np.asarray(x, dtype=F32)
        if self.qtype == "F16":
            x = x.astype(F16).astype(F32)                                # activations rounded to f16
        n, k = self.shape
        if k % 8:
            return x @ self.w.T                                          # tinyBLAS needs k % 8 == 0
        out = np.empty((x.shape[0], n), dtype=F32)
        wl = self.w.reshape(n, k // 8, 8)
        for i in range(0, x.shape[0], rows_per_chunk):
            xl = x[i:i + rows_per_chunk].reshape(-1, k // 8, 8)
            acc = np.zeros((xl.shape[0], n, 8), dtype=F32)
            for c in range(k // 8):
                acc = fma(xl[:, None, c, :], wl[None, :, c, :], acc)
            out[i:i + rows_per_chunk] = hsum8(acc)
        return out
