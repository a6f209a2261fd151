"""GEMV variants for the fused float16 decode step on Llama-2-7B shapes: TB/s of each, on the GPU at hand.

    OUT=DIR python tools/gpu_gemv_variants.py      # writes DIR/gemv_variants.json (one row per kernel/threads/shape)

U loads in flight per row, R rows a warp, with or without the folded RMSNorm (suffix n); CUDA events around 100
launches, medians of 5; each result checked against the float32 product. Measured it: results/gpu/2026-11-27-s10-fused.
"""
import json
import os

import cupy as cp
import numpy as np

SRC = r"""
#include <cuda_fp16.h>
__device__ __forceinline__ float warp_sum(float a) { for (int o = 16; o > 0; o >>= 1) a += __shfl_xor_sync(0xffffffffu, a, o); return a; }
__device__ __forceinline__ float dot8(uint4 raw, float4 u, float4 v) {
    const __half2* h = reinterpret_cast<const __half2*>(&raw);
    float2 f0 = __half22float2(h[0]), f1 = __half22float2(h[1]), f2 = __half22float2(h[2]), f3 = __half22float2(h[3]);
    return f0.x * u.x + f0.y * u.y + f1.x * u.z + f1.y * u.w + f2.x * v.x + f2.y * v.y + f3.x * v.z + f3.y * v.w;
}
__device__ __forceinline__ float4 mul4(float4 a, float4 b) { return make_float4(a.x * b.x, a.y * b.y, a.z * b.z, a.w * b.w); }
__device__ __forceinline__ float sq4(float4 a) { return a.x * a.x + a.y * a.y + a.z * a.z + a.w * a.w; }
template <int U, int R, bool NORM>
__device__ void gv(const __half* W, const float* x, const float* g, float* y, int n, int k, float eps) {
    int wg = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32, row0 = wg * R;
    if (row0 >= n) return;
    const uint4* w[R];
#pragma unroll
    for (int q = 0; q < R; ++q) w[q] = reinterpret_cast<const uint4*>(W + (size_t)min(row0 + q, n - 1) * k);
    const float4* xv = reinterpret_cast<const float4*>(x); const float4* gv4 = reinterpret_cast<const float4*>(g);
    float a[R][U], s[U];
#pragma unroll
    for (int r = 0; r < U; ++r) { s[r] = 0.f; for (int q = 0; q < R; ++q) a[q][r] = 0.f; }
    int k8 = k / 8, i = lane;
    for (; i + 32 * (U - 1) < k8; i += 32 * U) {
        uint4 raw[R][U];
#pragma unroll
        for (int q = 0; q < R; ++q)
#pragma unroll
            for (int r = 0; r < U; ++r) raw[q][r] = __ldcs(w[q] + i + 32 * r);
#pragma unroll
        for (int r = 0; r < U; ++r) {
            int c = i + 32 * r;
            float4 u = __ldg(xv + 2 * c), v = __ldg(xv + 2 * c + 1);
            if (NORM) { s[r] += sq4(u) + sq4(v); u = mul4(u, __ldg(gv4 + 2 * c)); v = mul4(v, __ldg(gv4 + 2 * c + 1)); }
#pragma unroll
            for (int q = 0; q < R; ++q) a[q][r] += dot8(raw[q][r], u, v);
        }
    }
    for (; i < k8; i += 32) {
        float4 u = __ldg(xv + 2 * i), v = __ldg(xv + 2 * i + 1);
        if (NORM) { s[0] += sq4(u) + sq4(v); u = mul4(u, __ldg(gv4 + 2 * i)); v = mul4(v, __ldg(gv4 + 2 * i + 1)); }
#pragma unroll
        for (int q = 0; q < R; ++q) a[q][0] += dot8(__ldcs(w[q] + i), u, v);
    }
    float ss = 0.f;
    if (NORM) { for (int r = 0; r < U; ++r) ss += s[r]; ss = warp_sum(ss); }
#pragma unroll
    for (int q = 0; q < R; ++q) {
        float d = 0.f;
        for (int r = 0; r < U; ++r) d += a[q][r];
        d = warp_sum(d);
        if (lane == 0 && row0 + q < n) y[row0 + q] = NORM ? d * (1.0f / sqrtf(ss / k + eps)) : d;
    }
}
#define K(NAME, U, R, NORM) extern "C" __global__ void NAME(const __half* W, const float* x, const float* g, float* y, int n, int k, float eps) { gv<U, R, NORM>(W, x, g, y, n, k, eps); }
K(u4r1n, 4, 1, true) K(u8r1n, 8, 1, true) K(u4r2n, 4, 2, true) K(u2r2n, 2, 2, true) K(u2r4n, 2, 4, true) K(u4r1, 4, 1, false) K(u8r1, 8, 1, false) K(u4r2, 4, 2, false) K(u2r2, 2, 2, false)
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
