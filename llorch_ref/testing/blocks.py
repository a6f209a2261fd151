"""Random quantized matrices for the kernels' tests and benchmarks: random codes with finite float16 scales."""
from __future__ import annotations

import numpy as np

from ..model.qtensor import QTensor, block_size

SCALES_AT = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2),
             "Q5_K": (0, 2), "Q6_K": (208,)}           # byte offsets of each block's float16 scales (and mins)


def random_qtensor(qt, n, k, seed):
    """[n, k] of qt: random blocks with finite float16 scales in 0.001-0.02 (random codes, as tinygrad's tests draw
    them)."""
    block, size = block_size(qt)
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n, k // block, size), dtype=np.uint8)
    for at in SCALES_AT[qt]:
        raw[..., at:at + 2] = rng.uniform(0.001, 0.02, (n, k // block, 1)).astype(np.float16).view(np.uint8)
    return QTensor(qt, (n, k), raw.reshape(n, -1), f"random {qt}")
