"""ONNX Runtime's CPU arithmetic for MatMulNBits at accuracy_level 4 (the model builder's default for int4 on
CPU): the activations are quantized to int8 in blocks of the weight's block size along K (scale = max|a| / 127,
round to nearest), multiplied with the int4 (or int8) weights in integers, and each block's integer sum scaled
by both scales in float32. Everything else is float32, as `exact`.

    m = NBitsMatrix(q, scales, zero_points, block_size)    # q: [N, K] weights as integers (zero point removed)
    m.matmul(x) -> [T, N] float32
"""
from __future__ import annotations

import numpy as np

F32 = np.float32


def quantize_int8_blocks(x, block: int):
    """x [T, K] -> (q [T, NB, block] integers in float32, scales [T, NB] float32): MLAS's QuantizeARow_CompInt8
    (a block of zeros gets scale 0). K is padded with zeros to a whole number of blocks."""
    t, k = x.shape
    nb = -(-k // block)
    xb = np.zeros((t, nb * block), dtype=F32)
    xb[:, :k] = x
    xb = xb.reshape(t, nb, block)
    amax = np.abs(xb).max(axis=-1)
    scale = (amax / F32(127.0)).astype(F32)
    inv = np.divide(F32(1.0), scale, out=np.zeros_like(scale), where=scale != 0).astype(F32)
    q = np.clip(np.round(xb * inv[:, :, None]), -127, 127).astype(F32)
    return q, scale


class NBitsMatrix:
    """A MatMulNBits weight [N, K] as its integers (zero point subtracted) and block scales."""

    def __init__(self, q, scales, block: int, qtype: str = "MatMulNBits4"):
        self.q = np.ascontiguousarray(q, dtype=F32)                      # [N, K] integers (|q| <= 128)
        self.scales = np.ascontiguousarray(scales, dtype=F32)            # [N, NB]
        self.block, self.qtype = int(block), qtype
        self.shape = self.q.shape

    @property
    def dtype(self):
        return np.dtype(F32)

    def rows(self, index) -> "NBitsMatrix":
        """The matrix of the rows `index` (a slice or a permutation): Q/K/V split, NeoX -> adjacent rows."""
        return NBitsMatrix(self.q[index], self.scales[index], self.block, self.qtype)

    def dequantized(self) -> np.ndarray:
        n, k = self.shape
        nb = self.scales.shape[1]
        w = np.zeros((n, nb * self.block), dtype=F32)
        w[:, :k] = self.q
        return (w.reshape(n, nb, self.block) * self.scales[:, :, None]).reshape(n, -1)[:, :k]

    def matmul(self, x, rows_per_chunk=16):
        x = np.asarray(x, dtype=F32)
        n, k = self.shape
        nb = self.scales.shape[1]
        wq = np.zeros((n, nb * self.block), dtype=F32)
        wq[:, :k] = self.q
        wq = wq.reshape(n, nb, self.block).transpose(1, 2, 0)            # [NB, block, N]
        out = np.empty((x.shape[0], n), dtype=F32)
        for i in range(0, x.shape[0], rows_per_chunk):
            qa, sa = quantize_int8_blocks(x[i:i + rows_per_chunk], self.block)
            dots = np.matmul(qa.transpose(1, 0, 2), wq)                  # [NB, t, N]: integers, exact in f32
            out[i:i + rows_per_chunk] = (dots * (sa.T[:, :, None] * self.scales.T[:, None, :])).sum(axis=0)
        return out
