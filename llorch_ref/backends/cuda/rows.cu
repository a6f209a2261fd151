#include <cuda_fp16.h>
typedef unsigned char u8;
#ifndef LLORCH_Q4K_SHARED               // Q4_K's scales decoded once for several octs and its blocks fetched a
#define LLORCH_Q4K_SHARED 1             // pass ahead (rows_dot); 0: a decode an oct, no fetch ahead
#endif

__device__ __forceinline__ float warp_sum(float a) {
    for (int o = 16; o > 0; o >>= 1) a += __shfl_xor_sync(0xffffffffu, a, o);
    return a;
}
// Programmatic dependent launch (sm_90+; no-ops when a kernel is launched without it): a kernel may start while
// the one before it finishes; it touches no memory until griddep_wait() returns (every earlier kernel complete,
// its writes visible), and lets the next kernel launch once all its blocks are running.
__device__ __forceinline__ void griddep_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}
// natural index e of a vector of k floats (k % 8 == 0) -> its place in the planar layout (rows_dot's PLANAR)
__device__ __forceinline__ int planar(int e, int k) { return ((e & 4) ? (k >> 1) : 0) + ((e >> 3) << 2) + (e & 3); }
__device__ __forceinline__ float f16at(const u8* p) {
    return __half2float(__ushort_as_half(*reinterpret_cast<const unsigned short*>(p)));
}
// small integer q (0 <= q < 2^23) -> (float)q - off, exactly, without the slow int-to-float conversion:
// the bits 0x4B000000 | q are the float 2^23 + q
__device__ __forceinline__ float fq(unsigned q, float off) {
    return __fsub_rn(__int_as_float(0x4B000000u | q), 8388608.0f + off);
}
// the same for the code (v & mask): the mask and the OR in one LOP3 (the compiler emits an AND and an OR when both
// constants are immediates; here the magic number lives in a register)
template <unsigned MASK> __device__ __forceinline__ float fqm(unsigned v, float off) {
    unsigned r;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(v), "n"(MASK), "r"(0x4B000000u));
    return __fsub_rn(__int_as_float(r), 8388608.0f + off);
}
__device__ __forceinline__ unsigned rd4(const u8* p) {                 // 4 bytes at a 2-byte-aligned address
    const unsigned short* h = reinterpret_cast<const unsigned short*>(p);
    return (unsigned)h[0] | ((unsigned)h[1] << 16);
}
__device__ __forceinline__ unsigned ld4(const u8* p) {                 // the same, streamed past the caches
    const unsigned short* h = reinterpret_cast<const unsigned short*>(p);
    return (unsigned)__ldcs(h) | ((unsigned)__ldcs(h + 1) << 16);
}
__device__ __forceinline__ float dot8(uint4 raw, float4 u, float4 v) {
    const __half2* h = reinterpret_cast<const __half2*>(&raw);
    float2 f0 = __half22float2(h[0]), f1 = __half22float2(h[1]), f2 = __half22float2(h[2]), f3 = __half22float2(h[3]);
    return f0.x * u.x + f0.y * u.y + f1.x * u.z + f1.y * u.w + f2.x * v.x + f2.y * v.y + f3.x * v.z + f3.y * v.w;
}
// sum_j (q_j - off) x_j over 8 codes, one per byte of a (weights 0-3) and b (4-7), BITS wide at each byte's bit 0.
// A code at bits 8-15 is taken in place as 256 q (one mask, no shift: 2^23 + 256 q is still exact), its product
// scaled back by 2^-8 once for the four of them: a sum of the same products, in another order.
template <int BITS> __device__ __forceinline__ float qdot8(unsigned a, unsigned b, float off, float4 u, float4 v) {
    constexpr unsigned M = (1u << BITS) - 1, M8 = M << 8;
    const float o8 = 256.f * off;
    unsigned a2 = a >> 16, b2 = b >> 16;
    float lo = fqm<M>(a, off) * u.x + fqm<M>(a2, off) * u.z + fqm<M>(b, off) * v.x + fqm<M>(b2, off) * v.z;
    float hi = fqm<M8>(a, o8) * u.y + fqm<M8>(a2, o8) * u.w + fqm<M8>(b, o8) * v.y + fqm<M8>(b2, o8) * v.w;
    return __fmaf_rn(hi, 0.00390625f, lo);
}

// Weight formats: a row of a matrix as the card holds it, read 8 weights (an oct) at a time, in blocks of BYTES
// bytes holding OCTS octs. f.load(blk, c) fetches what oct c (weights 8c..8c+7) needs from the start of its block,
// issued for several octs before any is used; f.dot(c, u, v, sx) =
// sum_j w_j x_j over the oct, x = (u, v), sx = sum_j x_j (for the types with an offset, OFFSET). Quantized types
// apply their scales once per oct, d * sum(q x) (+ m * sum(x)): the dequantized weights' products summed in another
// order of float32 roundings (and Q4_K's d sc q - dmin m not rounded to float32 first). load and dot read only the
// bits of c below 32 (where in its block an oct is), so callers pass the lane: constant through a row.
struct F16 {
    static constexpr bool OFFSET = false;
    static constexpr bool SHARES = false;
    static constexpr int OCTS = 1, BYTES = 16;
    uint4 w;
    __device__ __forceinline__ void load(const u8* blk, int) { w = __ldcs(reinterpret_cast<const uint4*>(blk)); }
    __device__ __forceinline__ float dot(int, float4 u, float4 v, float) const { return dot8(w, u, v); }
};
struct F32 {
    static constexpr bool OFFSET = false;
    static constexpr bool SHARES = false;
    static constexpr int OCTS = 1, BYTES = 32;
    float4 a, b;
    __device__ __forceinline__ void load(const u8* blk, int) {
        const float4* r = reinterpret_cast<const float4*>(blk);
        a = __ldcs(r); b = __ldcs(r + 1);
    }
    __device__ __forceinline__ float dot(int, float4 u, float4 v, float) const {
        return a.x * u.x + a.y * u.y + a.z * u.z + a.w * u.w + b.x * v.x + b.y * v.y + b.z * v.z + b.w * v.w;
    }
};
// a 2-byte-aligned block's float16 scale at its start and the 8 bytes at `at`
__device__ __forceinline__ void ld_scale_and_8(const u8* blk, int at, unsigned short& d, unsigned& a, unsigned& b) {
    d = __ldcs(reinterpret_cast<const unsigned short*>(blk));
    a = ld4(blk + at); b = ld4(blk + at + 4);
}
struct Q4_0 {                    // 18-byte blocks of 32: d, 16 bytes (weight j low nibble, j + 16 high); d (q - 8)
    static constexpr bool OFFSET = false;
    static constexpr bool SHARES = false;
    static constexpr int OCTS = 4, BYTES = 18;
    unsigned short d; unsigned a, b;
    __device__ __forceinline__ void load(const u8* blk, int c) { ld_scale_and_8(blk, 2 + 8 * (c & 1), d, a, b); }
    __device__ __forceinline__ float dot(int c, float4 u, float4 v, float) const {
        int sh = 2 * (c & 2);
        return __half2float(__ushort_as_half(d)) * qdot8<4>(a >> sh, b >> sh, 8.f, u, v);
    }
};
struct Q4_1 {                    // 20-byte blocks: d, m, 16 bytes of nibbles as Q4_0; d q + m
    static constexpr bool OFFSET = true;
    static constexpr bool SHARES = false;
    static constexpr int OCTS = 4, BYTES = 20;
    unsigned dm, a, b;
    __device__ __forceinline__ void load(const u8* blk, int c) {
        const unsigned* b4 = reinterpret_cast<const unsigned*>(blk);
        dm = __ldcs(b4); a = __ldcs(b4 + 1 + 2 * (c & 1)); b = __ldcs(b4 + 2 + 2 * (c & 1));
    }
    __device__ __forceinline__ float dot(int c, float4 u, float4 v, float sx) const {
        int sh = 2 * (c & 2);
        float d = __half2float(__ushort_as_half((unsigned short)dm)), m = __half2float(__ushort_as_half((unsigned short)(dm >> 16)));
        return __fmaf_rn(d, qdot8<4>(a >> sh, b >> sh, 0.f, u, v), m * sx);
    }
};
struct Q8_0 {                    // 34-byte blocks: d, 32 signed bytes; q d
    static constexpr bool OFFSET = false;
    static constexpr bool SHARES = false;
    static constexpr int OCTS = 4, BYTES = 34;
    unsigned short d; unsigned a, b;
    __device__ __forceinline__ void load(const u8* blk, int c) { ld_scale_and_8(blk, 2 + 8 * (c & 3), d, a, b); }
    __device__ __forceinline__ float dot(int, float4 u, float4 v, float) const {
        return __half2float(__ushort_as_half(d)) * qdot8<8>(a ^ 0x80808080u, b ^ 0x80808080u, 128.f, u, v);
    }
};
struct Q4_K {                    // 144-byte super-blocks of 256: d, dmin, 12 bytes of 6-bit scales and mins, 128 of
    static constexpr bool OFFSET = true;                // nibbles (groups 2i low, 2i + 1 high); (d sc) q - dmin m
    static constexpr bool SHARES = LLORCH_Q4K_SHARED;   // rows_dot decodes the scales once for several octs
    static constexpr int OCTS = 32, BYTES = 144;
    uint4 h; uint2 q;
    __device__ __forceinline__ void load(const u8* blk, int c) { h = head(blk); codes(blk, c); }
    __device__ __forceinline__ void codes(const u8* blk, int c) {
        q = __ldcs(reinterpret_cast<const uint2*>(blk + 16 + 32 * ((c >> 3) & 3) + 8 * (c & 3)));
    }
    __device__ static __forceinline__ uint4 head(const u8* blk) { return __ldcs(reinterpret_cast<const uint4*>(blk)); }
    // (d sc, dmin m) of group g (0-7) of the super-block whose first 16 bytes are h
    __device__ static __forceinline__ float2 scales(uint4 h, int g) {
        int s8 = 8 * (g & 3);
        unsigned A = (h.y >> s8) & 255, B = (h.z >> s8) & 255, C = (h.w >> s8) & 255;   // selects, not branches:
        unsigned sc = g < 4 ? A & 63 : (C & 15) | ((A >> 6) << 4);                      // the lanes of a warp
        unsigned mn = g < 4 ? B & 63 : (C >> 4) | ((B >> 6) << 4);                      // take both sides
        return make_float2(__fmul_rn(__half2float(__ushort_as_half((unsigned short)h.x)), fq(sc, 0.f)),
                           __fmul_rn(__half2float(__ushort_as_half((unsigned short)(h.x >> 16))), fq(mn, 0.f)));
    }
    __device__ __forceinline__ float dot_scaled(int c, float4 u, float4 v, float sx, float2 s) const {
        int sh = 4 * ((c >> 2) & 1);
        return __fmaf_rn(s.x, qdot8<4>(q.x >> sh, q.y >> sh, 0.f, u, v), -s.y * sx);
    }
    __device__ __forceinline__ float dot(int c, float4 u, float4 v, float sx) const {
        return dot_scaled(c, u, v, sx, scales(h, (c >> 2) & 7));
    }
};
struct Q6_K {                    // 210-byte super-blocks: 128 bytes of low nibbles, 64 of high pairs, 16 int8
    static constexpr bool OFFSET = false;               // scales, d; (d sc) (q - 32)
    static constexpr bool SHARES = false;
    static constexpr int OCTS = 32, BYTES = 210;
    unsigned l0, l1, h0, h1; unsigned short d; signed char sc;
    __device__ __forceinline__ void load(const u8* blk, int c) {
        int u = c >> 2, hf = (u >> 2) & 1, s = u & 3, p = c & 3;
        const u8* ql = blk + 64 * hf + 32 * (s & 1) + 8 * p;
        const u8* qh = blk + 128 + 32 * hf + 8 * p;
        l0 = ld4(ql); l1 = ld4(ql + 4); h0 = ld4(qh); h1 = ld4(qh + 4);
        d = __ldcs(reinterpret_cast<const unsigned short*>(blk + 208));
        sc = __ldcs(reinterpret_cast<const signed char*>(blk + 192 + 8 * hf + 2 * s + (p >> 1)));
    }
    __device__ __forceinline__ float dot(int c, float4 u, float4 v, float) const {
        int s = (c >> 2) & 3, lsh = (s >= 2) ? 4 : 0, hsh = 2 * s;
        unsigned a = ((l0 >> lsh) & 0x0F0F0F0Fu) | (((h0 >> hsh) & 0x03030303u) << 4);
        unsigned b = ((l1 >> lsh) & 0x0F0F0F0Fu) | (((h1 >> hsh) & 0x03030303u) << 4);
        float dd = __fmul_rn(__half2float(__ushort_as_half(d)), fq((unsigned)(unsigned char)sc ^ 128u, 128.f));
        return dd * qdot8<8>(a, b, 32.f, u, v);
    }
};

// The format GpuBlocks.repacked makes of Q6_K at load (cuda_blocks.REPACKED): the same codes and scales, every
// super-block 16-byte aligned, so that a lane fetches an oct's codes with two 8-byte loads instead of eight 2-byte
// ones. The same floats in the same operations as Q6_K: the same products to the bit.
struct Q6_KR {                   // Q6_K's 210-byte super-blocks, each padded to 224 bytes (16-byte aligned)
    static constexpr bool OFFSET = false;
    static constexpr bool SHARES = false;
    static constexpr int OCTS = 32, BYTES = 224;
    uint2 l, hq; unsigned short d; signed char sc;
    __device__ __forceinline__ void load(const u8* blk, int c) {
        int u = c >> 2, hf = (u >> 2) & 1, s = u & 3, p = c & 3;
        l = __ldcs(reinterpret_cast<const uint2*>(blk + 64 * hf + 32 * (s & 1) + 8 * p));
        hq = __ldcs(reinterpret_cast<const uint2*>(blk + 128 + 32 * hf + 8 * p));
        d = __ldcs(reinterpret_cast<const unsigned short*>(blk + 208));
        sc = __ldcs(reinterpret_cast<const signed char*>(blk + 192 + 8 * hf + 2 * s + (p >> 1)));
    }
    __device__ __forceinline__ float dot(int c, float4 u, float4 v, float) const {
        int s = (c >> 2) & 3, lsh = (s >= 2) ? 4 : 0, hsh = 2 * s;
        unsigned a = ((l.x >> lsh) & 0x0F0F0F0Fu) | (((hq.x >> hsh) & 0x03030303u) << 4);
        unsigned b = ((l.y >> lsh) & 0x0F0F0F0Fu) | (((hq.y >> hsh) & 0x03030303u) << 4);
        float dd = __fmul_rn(__half2float(__ushort_as_half(d)), fq((unsigned)(unsigned char)sc ^ 128u, 128.f));
        return dd * qdot8<8>(a, b, 32.f, u, v);
    }
};

__device__ __forceinline__ float4 mul4(float4 a, float4 b) { return make_float4(a.x * b.x, a.y * b.y, a.z * b.z, a.w * b.w); }
__device__ __forceinline__ float sq4(float4 a) { return a.x * a.x + a.y * a.y + a.z * a.z + a.w * a.w; }
__device__ __forceinline__ float sum8(float4 a, float4 b) { return ((a.x + a.y) + (a.z + a.w)) + ((b.x + b.y) + (b.z + b.w)); }

// R rows' dot products with x (times g when NORM), by W warps of a block of 128 threads together: each lane holds
// U octs a row in flight (lane l of warp part p takes octs l + 32 (U p + j), then every 32 U W further on: the warp
// reads x in contiguous 1 KB pieces), the W warps' sums added in a fixed order through shared memory. With NORM,
// ss = the sum of x^2 over the whole row. More rows share x's (and g's) loads and the sums of x the offset types
// need; more warps a row put more bytes in flight where the matrix has few rows or few bytes a weight. Every
// thread of the block must call it (W > 1 synchronizes the block); the results are in every lane of the W warps.
// PLANAR: x and g stored as two planes of k / 8 float4s, the first four floats of every oct, then the last four
// (planar() maps a natural index to its place): a warp's x loads read 512 contiguous bytes each instead of 1 KB
// with gaps, half the L1 wavefronts; the same floats in the same operations, so the same sums to the bit.
template <typename F, int U, int R, bool NORM, int W, bool PLANAR = false>
__device__ __forceinline__ void rows_dot(const u8* const* w, const float4* xv, const float4* gv, int k8, float* dot,
                                         float& ss) {
    griddep_wait();
    int lane = threadIdx.x % 32, part = (threadIdx.x / 32) % W;
    float a[R][U], s[U];
#pragma unroll
    for (int r = 0; r < U; ++r) {
        s[r] = 0.f;
#pragma unroll
        for (int q = 0; q < R; ++q) a[q][r] = 0.f;
    }
    constexpr int PASS = 32 / F::OCTS * F::BYTES;            // bytes of a row one pass of the warp (32 octs) covers
    const u8* p[R];                                           // the block of this lane's next oct, each row
#pragma unroll
    for (int q = 0; q < R; ++q) p[q] = w[q] + (size_t)(lane / F::OCTS) * F::BYTES + (size_t)(U * part) * PASS;
    int i = lane + 32 * U * part, i0 = 32 * U * part;
    // F::SHARES (Q4_K): the 4 lanes of an oct group need the same scales of each pass's super-block, so lane l
    // decodes those of pass SH j + l % SH (group l / 4) and the pass's lanes take them from it by a shuffle: one
    // decode for SH octs instead of one an oct, the same floats. Fewer instructions but more L1 traffic (the
    // shuffles): slower alone, faster with the next pass's blocks fetched before this pass's products (PIPE; the
    // other formats measured slower so; tools/gpu_roofline.py speed, q4k against q4k-oct)
    constexpr int SH = F::SHARES ? (U >= 4 ? 4 : U) : 1, STEP = 32 * U * W;
    constexpr bool PIPE = F::SHARES;
    static_assert(U % SH == 0, "U a multiple of the passes sharing a decode");
    // (Q4_K rows are whole super-blocks, k8 % 32 == 0: every lane of a warp runs as many passes; the bound written
    // without the lane lets the compiler see that, so the shuffles need no divergent-warp code)
    auto whole = [&](int at, int at0) { return F::SHARES ? at0 + 32 * U <= k8 : at + 32 * (U - 1) < k8; };
    auto fetch = [&](F (&dst)[R][U], float2 (&dsc)[R][U / SH]) {      // this pass's blocks, p[q] moved past them
#pragma unroll
        for (int q = 0; q < R; ++q) {
#pragma unroll
            for (int r = 0; r < U; ++r) {
                if constexpr (F::SHARES) dst[q][r].codes(p[q] + r * PASS, lane);
                else dst[q][r].load(p[q] + r * PASS, lane);
            }
            if constexpr (F::SHARES)
#pragma unroll
                for (int j = 0; j < U / SH; ++j) dsc[q][j] = F::scales(F::head(p[q] + (SH * j + lane % SH) * PASS), (lane >> 2) & 7);
            p[q] += U * W * PASS;
        }
    };
    // PIPE: the next pass's blocks fetched before this pass's products (twice the bytes in flight a warp)
    F raw[R][U];
    float2 sc[R][U / SH];
    if (PIPE && whole(i, i0)) fetch(raw, sc);
    for (; whole(i, i0); i += STEP, i0 += STEP) {
        F nxt[R][U];
        float2 nsc[R][U / SH];
        bool more = PIPE && whole(i + STEP, i0 + STEP);
        if (!PIPE) fetch(raw, sc);
        else if (more) fetch(nxt, nsc);
#pragma unroll
        for (int r = 0; r < U; ++r) {
            int c = i + 32 * r, cu = PLANAR ? c : 2 * c, cv = PLANAR ? k8 + c : 2 * c + 1;
            float4 u = __ldg(xv + cu), v = __ldg(xv + cv);
            if (NORM) { s[r] += sq4(u) + sq4(v); u = mul4(u, __ldg(gv + cu)); v = mul4(v, __ldg(gv + cv)); }
            float sx = F::OFFSET ? sum8(u, v) : 0.f;
#pragma unroll
            for (int q = 0; q < R; ++q) {
                if constexpr (F::SHARES) {
                    float2 t = sc[q][r / SH];
                    int from = (lane & ~3) | (r % SH);
                    if (SH > 1) t = make_float2(__shfl_sync(0xffffffffu, t.x, from), __shfl_sync(0xffffffffu, t.y, from));
                    a[q][r] += raw[q][r].dot_scaled(lane, u, v, sx, t);
                } else {
                    a[q][r] += raw[q][r].dot(lane, u, v, sx);
                }
            }
        }
        if (more) {
#pragma unroll
            for (int q = 0; q < R; ++q) {
#pragma unroll
                for (int r = 0; r < U; ++r) raw[q][r] = nxt[q][r];
#pragma unroll
                for (int j = 0; j < U / SH; ++j) sc[q][j] = nsc[q][j];
            }
        }
    }
    for (; i < k8; i += 32) {                   // the row's last piece, shorter than 32 U octs (one warp's)
        int cu = PLANAR ? i : 2 * i, cv = PLANAR ? k8 + i : 2 * i + 1;
        float4 u = __ldg(xv + cu), v = __ldg(xv + cv);
        if (NORM) { s[0] += sq4(u) + sq4(v); u = mul4(u, __ldg(gv + cu)); v = mul4(v, __ldg(gv + cv)); }
        float sx = F::OFFSET ? sum8(u, v) : 0.f;
#pragma unroll
        for (int q = 0; q < R; ++q) { F f; f.load(p[q], lane); a[q][0] += f.dot(lane, u, v, sx); p[q] += PASS; }
    }
    float t = 0.f;
#pragma unroll
    for (int r = 0; r < U; ++r) t += s[r];
    ss = NORM ? warp_sum(t) : 0.f;
#pragma unroll
    for (int q = 0; q < R; ++q) {
        float d = 0.f;
#pragma unroll
        for (int r = 0; r < U; ++r) d += a[q][r];
        dot[q] = warp_sum(d);
    }
    if constexpr (W > 1) {
        __shared__ float red[4][R + 1];
        int wi = threadIdx.x / 32, g0 = wi - part;
        if (lane == 0) {
#pragma unroll
            for (int q = 0; q < R; ++q) red[wi][q] = dot[q];
            red[wi][R] = ss;
        }
        __syncthreads();
#pragma unroll
        for (int q = 0; q < R; ++q) {
            float d = 0.f;
#pragma unroll
            for (int p = 0; p < W; ++p) d += red[g0 + p][q];
            dot[q] = d;
        }
        float z = 0.f;
#pragma unroll
        for (int p = 0; p < W; ++p) z += red[g0 + p][R];
        ss = z;
    }
}

// the rows of this thread's warp group (W warps, R rows; 4 / W groups a block of 128 threads): row pointers, rows
// past n reading the last row (computed, not written: every warp of the block takes part in rows_dot)
template <int R, int W> __device__ __forceinline__ int warp_rows(const u8* W_, int n, long rb, const u8** w) {
    int row0 = (blockIdx.x * (4 / W) + threadIdx.x / 32 / W) * R;
#pragma unroll
    for (int q = 0; q < R; ++q) w[q] = W_ + (size_t)min(row0 + q, n - 1) * rb;
    return row0;
}
// y[row] (+)= r sum_k W[row, k] x[k] (g[k]): R rows a group of W warps; NORM: the RMSNorm folded in (x times g, r =
// 1 / sqrt(mean(x^2) + eps) applied after the sum), else r = 1; ADD: added to y in place (the residual stream)
// PIN: x and g planar (rows_dot); POUT: y planar too (n its length)
template <typename F, int U, int R, int W, bool NORM, bool ADD, bool PIN = false, bool POUT = false>
__device__ void gemv_rows(const u8* Wm, const float* x, const float* g, float* y, int n, int k, long rb, float eps) {
    const u8* w[R];
    int row0 = warp_rows<R, W>(Wm, n, rb, w);
    float dot[R], ss;
    rows_dot<F, U, R, NORM, W, PIN>(w, reinterpret_cast<const float4*>(x), reinterpret_cast<const float4*>(g), k / 8,
                                    dot, ss);
    float r = NORM ? 1.0f / sqrtf(ss / k + eps) : 1.0f;
    if (threadIdx.x % (32 * W) == 0)
#pragma unroll
        for (int q = 0; q < R; ++q) {
            int at = POUT ? planar(row0 + q, n) : row0 + q;
            if (row0 + q < n) y[at] = ADD ? y[at] + dot[q] : NORM ? dot[q] * r : dot[q];
        }
}
