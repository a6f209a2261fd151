"""The CUDA C the cupy backend compiles: .cu files under llorch_ref/backends/cuda/ (package data), read with
importlib.resources and handed to cupy.RawModule(code=...) by the modules that compile them.

  kernels.cu  the op-by-op kernels (cupy_backend): GEMV, RMSNorm, RoPE, attention, softmax, argmax, the cache write
  rows.cu     reading a row of any weight format eight weights at a time, and rows_dot (cuda_blocks, cuda_fused)
  dequant.cu  a matrix of GGUF blocks dequantized to float32 as gguf-py does (cuda_blocks, after rows.cu)
  fused.cu    the fused decode step's gated-activation product (cuda_fused, after rows.cu)
  attend.cu   the fused decode step's RoPE, cache write and attention, and the embedding (cuda_fused)
"""
from __future__ import annotations

import functools
from importlib import resources

FILES = ("kernels.cu", "rows.cu", "dequant.cu", "fused.cu", "attend.cu")


@functools.lru_cache(maxsize=None)
def cuda_source(name: str) -> str:
    """The text of llorch_ref/backends/cuda/<name>, one of FILES."""
    if name not in FILES:
        raise ValueError(f"no CUDA source {name!r}; the package holds {', '.join(FILES)}")
    return resources.files(__package__).joinpath("cuda", name).read_text(encoding="utf-8")
