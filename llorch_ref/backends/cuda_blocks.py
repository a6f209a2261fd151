"""GGUF blocks on the GPU: a QTensor uploaded as the file holds it, multiplied by CUDA kernels.

Every kernel works on units of 32 weights (a Q4_0/Q4_1/Q8_0 block; an eighth of a Q4_K or Q6_K super-block),
eight weights at a time (oct), dequantized into the float32 values gguf-py's dequantization gives, operation
for operation
(the products and sums are rounded explicitly, __fmul_rn / __fadd_rn, so that the compiler fuses nothing
into an FMA there). Then:

  gemv          one token (decode): a warp per row; the warp stages 128 units of its row in shared memory
                with coalesced loads, 4 lanes share a unit (8 weights each) so that x is read in contiguous
                1 KB pieces; float32 accumulation, warp shuffle sum; integer codes become floats by the
                exact 2^23 trick (fq), not the slower int-to-float conversion
  dequant       several tokens (prefill): the matrix dequantized into a float32 scratch, then cuBLAS
                (TF32 off), the same product the float32 path computes

So a blocks product differs from the numpy oracle's (float32 weights from gguf-py, BLAS) by summation order
only. Types: Q4_0, Q4_1, Q8_0, Q4_K, Q6_K.
"""
from __future__ import annotations

TYPES = {"Q4_0": (0, 18, 32), "Q4_1": (1, 20, 32), "Q8_0": (2, 34, 32), "Q4_K": (3, 144, 256),
         "Q6_K": (4, 210, 256)}                # type -> (kernel code, bytes per block, weights per block)

SRC = r"""
#include <cuda_fp16.h>
typedef unsigned char u8;

__device__ __forceinline__ float f16at(const u8* p) {
    return __half2float(__ushort_as_half(*reinterpret_cast<const unsigned short*>(p)));
}
// small integer q (0 <= q < 2^22) -> (float)q - off, exactly, without the slow int-to-float conversion:
// the bits 0x4B000000 | q are the float 2^23 + q
__device__ __forceinline__ float fq(unsigned q, float off) {
    return __fsub_rn(__int_as_float(0x4B000000u | q), 8388608.0f + off);
}

__device__ __forceinline__ unsigned rd4(const u8* p) {                 // 4 bytes at a 2-byte-aligned address
    const unsigned short* h = reinterpret_cast<const unsigned short*>(p);
    return (unsigned)h[0] | ((unsigned)h[1] << 16);
}

// weights 8p..8p+7 of unit u (32 weights) of a row of blocks -> w[0..7], as gguf-py dequantizes them
// (the unit's scales decoded once for the eight)
template <int T> __device__ __forceinline__ void oct(const u8* row, int u, int p, float* w) {
    if constexpr (T == 0) {                                   // Q4_0: d * (q - 8); elements j low, j+16 high
        const u8* b = row + (size_t)u * 18;
        float d = f16at(b);
        unsigned v[2] = {rd4(b + 2 + 8 * (p & 1)), rd4(b + 6 + 8 * (p & 1))}, sh = 4 * (p >> 1);
#pragma unroll
        for (int k = 0; k < 8; ++k) w[k] = __fmul_rn(d, fq((v[k >> 2] >> (8 * (k & 3) + sh)) & 15, 8.f));
    } else if constexpr (T == 1) {                            // Q4_1: d * q + m
        const u8* b = row + (size_t)u * 20;
        float d = f16at(b), m = f16at(b + 2);
        const unsigned* q = reinterpret_cast<const unsigned*>(b + 4 + 8 * (p & 1));
        unsigned v[2] = {q[0], q[1]}, sh = 4 * (p >> 1);
#pragma unroll
        for (int k = 0; k < 8; ++k) w[k] = __fadd_rn(__fmul_rn(d, fq((v[k >> 2] >> (8 * (k & 3) + sh)) & 15, 0.f)), m);
    } else if constexpr (T == 2) {                            // Q8_0: q * d
        const u8* b = row + (size_t)u * 34;
        float d = f16at(b);
        unsigned v[2] = {rd4(b + 2 + 8 * p), rd4(b + 6 + 8 * p)};
#pragma unroll
        for (int k = 0; k < 8; ++k) w[k] = __fmul_rn(fq(((v[k >> 2] >> (8 * (k & 3))) & 255) ^ 128, 128.f), d);
    } else if constexpr (T == 3) {                            // Q4_K: (d * sc) * q - dmin * m, group g of 8
        const u8* b = row + (size_t)(u >> 3) * 144;
        int g = u & 7;
        const u8* s = b + 4;
        int sc, mn;
        if (g < 4) { sc = s[g] & 63; mn = s[g + 4] & 63; }
        else { sc = (s[g + 4] & 15) | ((s[g - 4] >> 6) << 4); mn = (s[g + 4] >> 4) | ((s[g] >> 6) << 4); }
        float d = __fmul_rn(f16at(b), (float)sc), dm = __fmul_rn(f16at(b + 2), (float)mn);
        uint2 q = *reinterpret_cast<const uint2*>(b + 16 + 32 * (g >> 1) + 8 * p);
        unsigned v[2] = {q.x, q.y}, sh = 4 * (g & 1);
#pragma unroll
        for (int k = 0; k < 8; ++k) w[k] = __fsub_rn(__fmul_rn(d, fq((v[k >> 2] >> (8 * (k & 3) + sh)) & 15, 0.f)), dm);
    } else {                                                  // Q6_K: (d * sc) * (q - 32), chunk s of half h
        const u8* b = row + (size_t)(u >> 3) * 210;
        int h = (u >> 2) & 1, s = u & 3;
        const u8* ql = b + 64 * h + 32 * (s & 1) + 8 * p;
        const u8* qh = b + 128 + 32 * h + 8 * p;
        float d = __fmul_rn(f16at(b + 208), (float)reinterpret_cast<const signed char*>(b + 192)[8 * h + 2 * s + (p >> 1)]);
        unsigned l[2] = {rd4(ql), rd4(ql + 4)}, hi[2] = {rd4(qh), rd4(qh + 4)};
        int lshift = (s >= 2) ? 4 : 0, hshift = 2 * s;
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            unsigned q = ((l[k >> 2] >> (8 * (k & 3) + lshift)) & 15) | (((hi[k >> 2] >> (8 * (k & 3) + hshift)) & 3) << 4);
            w[k] = __fmul_rn(d, fq(q, 32.f));
        }
    }
}

// bytes of 32 units (a chunk): 32 blocks of 32 weights, or 4 super-blocks
template <int T> constexpr int chunk_bytes() { return T == 0 ? 576 : T == 1 ? 640 : T == 2 ? 1088 : T == 3 ? 576 : 840; }

// y[row] = sum_k W[row, k] x[k]: a warp per row, 8 rows a block of 256 threads. The warp copies STEP
// chunks of its row (32 units each) into shared memory with coalesced loads of `vec` bytes (16, 4 or 2: what
// the row and chunk sizes allow), all in flight together; then 4 lanes share a unit, lane j taking weights
// 8(j%4)..8(j%4)+7 of unit j/4 (+8 per pass), so that the warp reads x in 1 KB contiguous pieces.
constexpr int STEP = 4;
template <int T, typename V> __device__ void gemv(const u8* __restrict__ W, const float* __restrict__ x,
                                                  float* __restrict__ y, int n, int units, long row_bytes) {
    constexpr int CB = chunk_bytes<T>();
    __shared__ __align__(16) u8 stage[8][STEP * CB];
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32, row = blockIdx.x * 8 + warp;
    if (row >= n) return;
    const u8* r = W + (size_t)row * row_bytes;
    u8* sm = stage[warp];
    int part = lane & 3, sub = lane >> 2;
    float acc = 0.f;
    for (int u0 = 0; u0 < units; u0 += 32 * STEP) {
        long off = (long)u0 * CB / 32;
        int bytes = (int)min((long)(STEP * CB), row_bytes - off);
        const V* src = reinterpret_cast<const V*>(r + off);
        V* dst = reinterpret_cast<V*>(sm);
        for (int i = lane; i < bytes / (int)sizeof(V); i += 32) dst[i] = __ldcs(src + i);
        __syncwarp();
        int nu = min(32 * STEP, units - u0);
#pragma unroll 4
        for (int k = sub; k < nu; k += 8) {
            float w[8];
            oct<T>(sm + (k >> 5) * CB, k & 31, part, w);
            const float4* xv = reinterpret_cast<const float4*>(x + 32 * (u0 + k) + 8 * part);
            float4 v0 = __ldg(xv), v1 = __ldg(xv + 1);
            acc += w[0] * v0.x + w[1] * v0.y + w[2] * v0.z + w[3] * v0.w
                 + w[4] * v1.x + w[5] * v1.y + w[6] * v1.z + w[7] * v1.w;
        }
        __syncwarp();
    }
    for (int off = 16; off > 0; off >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, off);
    if (lane == 0) y[row] = acc;
}

// The same product reading the blocks straight from global memory (no staging): 4 lanes share a unit, each
// pass of the warp covers 8 consecutive units; 4 passes unrolled keep their loads in flight together.
template <int T> __device__ void gemv_direct(const u8* __restrict__ W, const float* __restrict__ x,
                                             float* __restrict__ y, int n, int units, long row_bytes) {
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32, row = blockIdx.x * 8 + warp;
    if (row >= n) return;
    const u8* r = W + (size_t)row * row_bytes;
    int part = lane & 3, sub = lane >> 2;
    float acc = 0.f;
#pragma unroll 4
    for (int u = sub; u < units; u += 8) {
        float w[8];
        oct<T>(r, u, part, w);
        const float4* xv = reinterpret_cast<const float4*>(x + 32 * u + 8 * part);
        float4 v0 = __ldg(xv), v1 = __ldg(xv + 1);
        acc += w[0] * v0.x + w[1] * v0.y + w[2] * v0.z + w[3] * v0.w
             + w[4] * v1.x + w[5] * v1.y + w[6] * v1.z + w[7] * v1.w;
    }
    for (int off = 16; off > 0; off >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, off);
    if (lane == 0) y[row] = acc;
}

// the whole matrix as float32 [n, 32 * units]: a thread per 8 weights
template <int T> __device__ void dequant(const u8* __restrict__ W, float* __restrict__ out, int n, int units,
                                         long row_bytes) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long)n * units * 4) return;
    long q = i / 4;
    int row = (int)(q / units), u = (int)(q % units), p = (int)(i % 4);
    float w[8];
    oct<T>(W + (size_t)row * row_bytes, u, p, w);
    float4* o = reinterpret_cast<float4*>(out) + 2 * i;
    o[0] = make_float4(w[0], w[1], w[2], w[3]);
    o[1] = make_float4(w[4], w[5], w[6], w[7]);
}

#define KERNELS(T, NAME) \
extern "C" __global__ void gemv16_##NAME(const u8* W, const float* x, float* y, int n, int units, long rb) \
    { gemv<T, uint4>(W, x, y, n, units, rb); } \
extern "C" __global__ void gemv4_##NAME(const u8* W, const float* x, float* y, int n, int units, long rb) \
    { gemv<T, unsigned>(W, x, y, n, units, rb); } \
extern "C" __global__ void gemv2_##NAME(const u8* W, const float* x, float* y, int n, int units, long rb) \
    { gemv<T, unsigned short>(W, x, y, n, units, rb); } \
extern "C" __global__ void gemvd_##NAME(const u8* W, const float* x, float* y, int n, int units, long rb) \
    { gemv_direct<T>(W, x, y, n, units, rb); } \
extern "C" __global__ void dequant_##NAME(const u8* W, float* out, int n, int units, long rb) \
    { dequant<T>(W, out, n, units, rb); }
KERNELS(0, q4_0)
KERNELS(1, q4_1)
KERNELS(2, q8_0)
KERNELS(3, q4_k)
KERNELS(4, q6_k)
"""

_MODULE = {}
# one-token products: the staged kernel (gemv) for the K-quants, gemv_direct for the others (the faster of the
# two for each type on 7B-shaped matrices: results/gpu/2026-11-27-h200-roofline-profile.md)
STAGED = {"Q4_0": False, "Q4_1": False, "Q8_0": False, "Q4_K": True, "Q6_K": True}


def kernels(cp):
    """{"gemv_q4_0": RawKernel, "dequant_q4_0": ..., ...}, compiled once per process."""
    if not _MODULE:
        mod = cp.RawModule(code=SRC, options=("-std=c++17",))
        for qtype in TYPES:
            for kind in ("gemv16", "gemv4", "gemv2", "gemvd", "dequant"):
                name = f"{kind}_{qtype.lower()}"
                _MODULE[name] = mod.get_function(name)
    return _MODULE


class GpuBlocks:
    """A quantized matrix [N, K] on the GPU as the file holds it (uint8 [N, row bytes]); matmul(x) by the
    kernels above. From a QTensor (upload), or from blocks already on the device (random models)."""

    ndim = 2

    def __init__(self, qtype, shape, blocks, cp):
        if qtype not in TYPES:
            raise ValueError(f"no GPU kernel for {qtype} (have {', '.join(TYPES)})")
        self.qtype, self.shape, self.blocks, self.cp = qtype, tuple(shape), blocks, cp
        self.units = self.shape[1] // 32
        chunk = {"Q4_0": 576, "Q4_1": 640, "Q8_0": 1088, "Q4_K": 576, "Q6_K": 840}[qtype]
        row_bytes = int(blocks.shape[1])
        self.vec = next(v for v in (16, 4, 2) if row_bytes % v == 0 and chunk % v == 0)
        self.dtype = cp.dtype(cp.float32)              # what a product returns
        self._k = kernels(cp)

    def __getitem__(self, rows):
        """Rows lo:hi (a slice), a view of the same device memory."""
        lo, hi, _ = rows.indices(self.shape[0])
        return GpuBlocks(self.qtype, (hi - lo, self.shape[1]), self.blocks[lo:hi], self.cp)

    @classmethod
    def from_qtensor(cls, qt, cp):
        return cls(qt.qtype, qt.shape, cp.asarray(qt.blocks), cp)

    @property
    def nbytes(self) -> int:
        return int(self.blocks.nbytes)

    def dequantize(self):
        """-> float32 [N, K] on the device."""
        cp, n = self.cp, self.shape[0]
        out = cp.empty(self.shape, dtype=cp.float32)
        total = n * self.units * 4
        self._k[f"dequant_{self.qtype.lower()}"](((total + 255) // 256,), (256,),
                                                 (self.blocks, out, cp.int32(n), cp.int32(self.units),
                                                  cp.int64(self.blocks.shape[1])))
        return out

    def gemv_kernel(self, staged=None):
        staged = STAGED[self.qtype] if staged is None else staged
        return self._k[f"gemv{self.vec}_{self.qtype.lower()}" if staged else f"gemvd_{self.qtype.lower()}"]

    def matmul(self, x):
        """x: [T, K] float32 -> [T, N] float32: the GEMV kernel for one token, dequantize + cuBLAS for more."""
        cp = self.cp
        x = cp.ascontiguousarray(x, dtype=cp.float32)
        n = self.shape[0]
        if x.shape[0] != 1:
            return x @ self.dequantize().T
        y = cp.empty((1, n), dtype=cp.float32)
        self.gemv_kernel()(((n + 7) // 8,), (256,),
                                              (self.blocks, x, y, cp.int32(n), cp.int32(self.units),
                                               cp.int64(self.blocks.shape[1])))
        return y
