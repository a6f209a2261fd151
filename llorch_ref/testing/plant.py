"""Plant a scale error in one weight matrix of a GGUF file, in place of its blocks: the block scales (d, and
m / dmin where the type has one) are multiplied by `factor`, so every dequantized weight of the matrix is
multiplied by it (up to the f16 rounding of the new scales). The rest of the file is untouched, so an engine
under test runs exactly the original quantization with one matrix off by a known amount.

    plant_scale("m.gguf", "m-up11x1.01.gguf", "blk.11.ffn_up.weight", 1.01)
"""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

# type name -> (bytes per block, byte offsets of the f16 scales that multiply every weight of the block)
SCALES = {"Q4_0": (18, (0,)), "Q4_1": (20, (0, 2)), "Q5_0": (22, (0,)), "Q5_1": (24, (0, 2)), "Q8_0": (34, (0,)),
          "Q2_K": (84, (80, 82)), "Q3_K": (110, (108,)), "Q4_K": (144, (0, 2)), "Q5_K": (176, (0, 2)),
          "Q6_K": (210, (208,))}


def plant_scale(src, dst, tensor: str, factor: float) -> Path:
    """Copy src to dst with every weight of `tensor` multiplied by factor (through its block scales)."""
    import gguf

    src, dst = Path(src), Path(dst)
    if src.resolve() == dst.resolve():
        raise ValueError("plant_scale writes a copy: dst must differ from src")
    shutil.copyfile(src, dst)
    reader = gguf.GGUFReader(dst, "r+")
    t = next((t for t in reader.tensors if t.name == tensor), None)
    if t is None:
        raise KeyError(f"{src}: no tensor {tensor!r}")
    kind = t.tensor_type.name
    if kind in ("F32", "F16"):
        t.data[...] = (t.data.astype(np.float32) * np.float32(factor)).astype(t.data.dtype)
    elif kind in SCALES:
        size, offsets = SCALES[kind]
        blocks = t.data.reshape(-1, size)
        for off in offsets:
            d = blocks[:, off:off + 2].copy().view(np.float16)
            blocks[:, off:off + 2] = (d.astype(np.float32) * np.float32(factor)).astype(np.float16).view(np.uint8)
    else:
        raise ValueError(f"{tensor}: type {kind} has no scale table here (known: F32, F16, {', '.join(SCALES)})")
    reader.data.flush()
    del reader
    return dst
