"""The backends' switches, in one place. Each is an environment variable, read when the code it governs runs (a test
or tools/gpu_roofline.py sets one to compare a path with the one it replaces); unset, the default path runs.

  LLORCH_BLAS_SPLIT=auto|split|blas  CPU: split a prompt's BLAS products over the backend's threads while other
                                     processes hold cores (auto), always (split), or leave BLAS its threads (blas)
  LLORCH_NUMBA_FUSED=0               numba: one-token steps op by op instead of FusedDecoder's fused layer step
  LLORCH_CUDA_GRAPHS=0               cupy: decode steps run eagerly instead of replaying a captured CUDA graph
  LLORCH_CUDA_CHAIN=0                cupy: greedy steps one at a time instead of chained on the device
  LLORCH_CUDA_FUSED=0                cupy: the op-by-op decode step instead of cuda_fused's five kernels a layer
  LLORCH_CUDA_PDL=0                  cupy: the fused step's kernels without programmatic dependent launch
  LLORCH_CUDA_PLANAR=0               cupy: the fused step's vectors in the natural layout only (no planar one)
  LLORCH_CUDA_FUSED_NORM=0           cupy: residual adds and RMSNorms one by one where nobody watches
  LLORCH_CUDA_HALF_PREFILL=0         cupy float16: prompts' products cast back by CuPy, attention as recorded
  LLORCH_CUDA_Q4K_SHARED=0           cupy blocks: Q4_K's scales decoded once an oct, no blocks fetched ahead
  LLORCH_CUDA_REPACK=0               cupy blocks: Q6_K kept in the file's layout (no aligned repacking)

Every switch leaves the results within the backend's band; tests/test_backends.py compares each pair of paths.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, fields

from ..errors import ParameterError

BLAS_SPLIT_MODES = ("auto", "split", "blas")


@dataclass(frozen=True)
class Settings:
    """The switches as they stand (True: the default path). settings() reads them from the environment."""
    blas_split: str = "auto"
    numba_fused: bool = True
    cuda_graphs: bool = True
    cuda_chain: bool = True
    cuda_fused: bool = True
    cuda_pdl: bool = True
    cuda_planar: bool = True
    cuda_fused_norm: bool = True
    cuda_half_prefill: bool = True
    cuda_q4k_shared: bool = True
    cuda_repack: bool = True


def env_name(field: str) -> str:
    """A Settings field's environment variable: LLORCH_ and the field's name in capitals."""
    return "LLORCH_" + field.upper()


def settings(environ=None) -> Settings:
    """The switches from `environ` (default os.environ): a flag is off when its variable is "0"; LLORCH_BLAS_SPLIT
    must be one of BLAS_SPLIT_MODES."""
    env = os.environ if environ is None else environ
    mode = env.get(env_name("blas_split")) or "auto"
    if mode not in BLAS_SPLIT_MODES:
        raise ParameterError(f"LLORCH_BLAS_SPLIT={mode!r} must be auto, split or blas")
    flags = {f.name: env.get(env_name(f.name), "1") != "0" for f in fields(Settings) if f.type in (bool, "bool")}
    return Settings(blas_split=mode, **flags)
