"""QTensor: a quantized matrix as its file holds it, the one type every quantized path starts from.

A QTensor carries its GGUF blocks (a view of the mapped file, no copy), their ggml type and the matrix
shape [N, K] in NumPy order; `dequantize()` gives the float32 matrix (gguf-py's dequantization, the
oracle's weights). Loaders return QTensors; the lazy-weight cache dequantizes them when a layer runs;
backends and numerics decide how to multiply by them (numba: its kernels' layout; numerics "ggml":
llama.cpp's integer products; cupy: the blocks on the GPU), the way candle's QMatMul::from_qtensor does.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from .ggml_types import block_size


@dataclass(frozen=True)
class QTensor:
    qtype: str                   # ggml type name, e.g. "Q4_K"
    shape: tuple                 # (N, K): N rows (outputs) of K weights (inputs)
    blocks: np.ndarray           # uint8 [N, K / block * bytes per block], row r's blocks in file order
    name: str = ""               # the tensor's name in its file, for messages
    release: Callable | None = field(default=None, repr=False, compare=False)   # (blocks) -> drops their pages

    def __post_init__(self):
        n, k = self.shape
        block, size = block_size(self.qtype)
        if k % block or self.blocks.shape != (n, k // block * size) or self.blocks.dtype != np.uint8:
            raise ValueError(f"{self.name or 'QTensor'}: {self.qtype} blocks {self.blocks.shape} "
                             f"{self.blocks.dtype} do not hold a [{n}, {k}] matrix")

    @property
    def block_len(self) -> int:
        return block_size(self.qtype)[0]

    @property
    def nbytes(self) -> int:
        return self.blocks.nbytes

    def rows(self, lo: int, hi: int) -> "QTensor":
        """Rows lo..hi (a view: the blocks of a row are independent of the others)."""
        return QTensor(self.qtype, (hi - lo, self.shape[1]), self.blocks[lo:hi], self.name, self.release)

    def dequantize(self, lo: int = 0, hi: int | None = None) -> np.ndarray:
        """Rows lo..hi (default all) as float32 [rows, K], by gguf-py."""
        from gguf import GGMLQuantizationType, quants

        raw = np.asarray(self.blocks[lo:hi])
        out = quants.dequantize(raw, GGMLQuantizationType[self.qtype])
        return np.ascontiguousarray(out.reshape(raw.shape[0], self.shape[1]), dtype=np.float32)

    def drop_pages(self):
        """Release this tensor's pages of the mapping from the process (they stay in the page cache)."""
        if self.release is not None:
            self.release(self.blocks)
