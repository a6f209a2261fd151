"""Random quantized matrices for the kernels' tests and benchmarks: random codes with finite float16 scales."""
from __future__ import annotations

import zlib

import numpy as np

from ..model.ggml_types import block_size
from ..model.qtensor import QTensor

SCALES_AT = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2),
             "Q5_K": (0, 2), "Q6_K": (208,), "Q2_K": (80, 82), "Q3_K": (108,)}           # byte offsets of each block's float16 scales (and mins)


def random_qtensor(qt, n, k, seed):
    """[n, k] of qt: random blocks with finite float16 scales in 0.001-0.02 (random codes, as tinygrad's tests draw
    them)."""
    block, size = block_size(qt)
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n, k // block, size), dtype=np.uint8)
    for at in SCALES_AT[qt]:
        raw[..., at:at + 2] = rng.uniform(0.001, 0.02, (n, k // block, 1)).astype(np.float16).view(np.uint8)
    return QTensor(qt, (n, k), raw.reshape(n, -1), f"random {qt}")


def seeded_rng(name, seed):
    """A generator seeded by a tensor's name and a seed: the same draws whatever else is drawn."""
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


def random_blocks(name, rows, cols, qtype, std, seed) -> np.ndarray:
    """-> uint8 [rows, cols / block * block_bytes]: random blocks of qtype with weights of about `std`."""
    per, size = block_size(qtype)
    nb = rows * cols // per
    rng = seeded_rng(name, seed)
    out = rng.integers(0, 256, size=(nb, size), dtype=np.uint8)
    if qtype == "Q8_0":
        out[:, 2:] = np.clip(out[:, 2:].view(np.int8), -127, 127).view(np.uint8)
        d = np.full(nb, std / 73.3, dtype=np.float16)               # uniform int8 in [-127, 127]: std 73.3
        out[:, 0:2] = d.view(np.uint8).reshape(nb, 2)
    elif qtype == "Q4_0":                                            # w = d * (q - 8), q uniform in 0..15
        d = np.full(nb, std / 4.61, dtype=np.float16)
        out[:, 0:2] = d.view(np.uint8).reshape(nb, 2)
    elif qtype == "Q4_1":                                            # w = d * q + m, m = -7.5 d
        d = np.full(nb, std / 4.61, dtype=np.float16)
        out[:, 0:2] = d.view(np.uint8).reshape(nb, 2)
        out[:, 2:4] = (d.astype(np.float32) * -7.5).astype(np.float16).view(np.uint8).reshape(nb, 2)
    elif qtype == "Q6_K":                                            # w = d * sc * (q - 32), sc in -64..63
        out[:, 192:208] = ((out[:, 192:208] // 2).astype(np.int16) - 64).astype(np.int8).view(np.uint8)
        d = np.full(nb, std / (37.0 * 18.5), dtype=np.float16)
        out[:, 208:210] = d.view(np.uint8).reshape(nb, 2)
    elif qtype == "Q3_K":                                            # w = d * (sc - 32) * q, q in -4..3
        d = np.full(nb, std / 43.3, dtype=np.float16)
        out[:, 108:110] = d.view(np.uint8).reshape(nb, 2)
    elif qtype == "Q2_K":                                            # w = d*a*q - dmin*m, a, m 0..15, q 0..3
        d = np.full(nb, std / 14.8, dtype=np.float16)
        out[:, 80:82] = d.view(np.uint8).reshape(nb, 2)
        out[:, 82:84] = (d.astype(np.float32) * 1.5).astype(np.float16).view(np.uint8).reshape(nb, 2)
    else:                                                            # Q4_K: w = d*sc*q - dmin*m
        d = np.full(nb, std / 259.0, dtype=np.float16)
        out[:, 0:2] = d.view(np.uint8).reshape(nb, 2)
        out[:, 2:4] = (d.astype(np.float32) * 7.5).astype(np.float16).view(np.uint8).reshape(nb, 2)
    return out.reshape(rows, -1)
