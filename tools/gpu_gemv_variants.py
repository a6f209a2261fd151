"""GEMV variants for the fused float16 decode step on Llama-2-7B shapes: TB/s of each, on the GPU at hand.

    OUT=DIR python tools/gpu_gemv_variants.py      # writes DIR/gemv_variants.json (one row per kernel/threads/shape)

U loads in flight per row, R rows a warp, with or without the folded RMSNorm (suffix n); CUDA events around 100
launches, medians of 5; each result checked against the float32 product.
"""
import json
import os
import sys
from pathlib import Path

import cupy as cp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from llorch_ref.backends.cuda_fused import SRC as FUSED  # noqa: E402  (rows_dot: the fused step's own product)

SRC = FUSED + r"""
template <int U, int R, bool NORM>
__device__ void gv(const __half* W, const float* x, const float* g, float* y, int n, int k, float eps) {
    int row0 = (blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32) * R, lane = threadIdx.x % 32;
    if (row0 >= n) return;
    const uint4* w[R];
    for (int q = 0; q < R; ++q) w[q] = reinterpret_cast<const uint4*>(W + (size_t)min(row0 + q, n - 1) * k);
    float dot[R], ss;
    rows_dot<U, R, NORM>(w, reinterpret_cast<const float4*>(x), reinterpret_cast<const float4*>(g), k / 8, lane, dot,
                         ss);
    if (lane == 0)
        for (int q = 0; q < R; ++q)
            if (row0 + q < n) y[row0 + q] = NORM ? dot[q] * (1.0f / sqrtf(ss / k + eps)) : dot[q];
}
#define K(NAME, U, R, NORM) extern "C" __global__ void NAME(const __half* W, const float* x, const float* g, float* y, \
                                                           int n, int k, float eps) { gv<U, R, NORM>(W, x, g, y, n, k, eps); }
K(u4r1n, 4, 1, true) K(u8r1n, 8, 1, true) K(u4r2n, 4, 2, true) K(u2r2n, 2, 2, true) K(u2r4n, 2, 4, true)
K(u4r1, 4, 1, false) K(u8r1, 8, 1, false) K(u4r2, 4, 2, false) K(u2r2, 2, 2, false)
"""
mod = cp.RawModule(code=SRC, options=("-std=c++17",))
shapes = [(12288, 4096), (4096, 4096), (4096, 11008), (22016, 4096), (32000, 4096)]
res = []
ev0, ev1 = cp.cuda.Event(), cp.cuda.Event()
for name, R in (("u4r1n", 1), ("u8r1n", 1), ("u4r2n", 2), ("u2r2n", 2), ("u2r4n", 4), ("u4r1", 1), ("u8r1", 1), ("u4r2", 2), ("u2r2", 2)):
    f = mod.get_function(name)
    for threads in (128, 256):
        for n, k in shapes:
            W = cp.random.standard_normal((n, k), dtype=cp.float32).astype(cp.float16)
            x = cp.random.standard_normal(k, dtype=cp.float32); g = cp.ones(k, cp.float32); y = cp.empty(n, cp.float32)
            warps = threads // 32
            grid = ((n + R * warps - 1) // (R * warps),)
            args = (W, x, g, y, np.int32(n), np.int32(k), np.float32(1e-5))
            for _ in range(10): f(grid, (threads,), args)
            ts = []
            for _ in range(5):
                ev0.record(); [f(grid, (threads,), args) for _ in range(100)]; ev1.record(); ev1.synchronize()
                ts.append(cp.cuda.get_elapsed_time(ev0, ev1) / 100)
            ms = float(np.median(ts))
            ref = (W.astype(cp.float32) @ x) * (1.0 / cp.sqrt((x * x).mean() + 1e-5) if name.endswith("n") else 1.0)
            err = float(cp.abs(y - ref).max() / cp.abs(ref).max())
            r = {"kernel": name, "threads": threads, "shape": [n, k], "ms": round(ms, 4), "tb_s": round(W.nbytes / ms / 1e9, 3), "rel_err": err}
            res.append(r); print(json.dumps(r), flush=True)
            del W
out = os.environ.get("OUT", ".")
open(os.path.join(out, "gemv_variants.json"), "w").write(json.dumps(res, indent=1))
