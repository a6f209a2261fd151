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
    } else {                                                  // Q6_K: (d * sc) * (q - 32), chunk s of half h;
        const u8* b = row + (size_t)(u >> 3) * (T == 5 ? 224 : 210);    // T 5: its super-blocks padded (Q6_KR)
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

// the same weights rounded to float16 (round to nearest even) [n, 32 * units], for tensor-core products
template <int T> __device__ void dequant_half(const u8* __restrict__ W, __half* __restrict__ out, int n, int units,
                                              long row_bytes) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long)n * units * 4) return;
    long q = i / 4;
    int row = (int)(q / units), u = (int)(q % units), p = (int)(i % 4);
    float w[8];
    oct<T>(W + (size_t)row * row_bytes, u, p, w);
    __half2 h[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) h[k] = __floats2half2_rn(w[2 * k], w[2 * k + 1]);
    reinterpret_cast<uint4*>(out)[i] = *reinterpret_cast<uint4*>(h);
}

// the same weights as two float16 parts a row, hi = fp16(w) in columns [0, K) and lo = fp16((w - hi) * 2^11) in
// [K, 2K) (w = hi + lo * 2^-11 to about 22 bits), for split products that keep float32's band on tensor cores
template <int T> __device__ void dequant_split(const u8* __restrict__ W, __half* __restrict__ out, int n, int units,
                                               long row_bytes) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long)n * units * 4) return;
    long q = i / 4;
    int row = (int)(q / units), u = (int)(q % units), p = (int)(i % 4);
    float w[8];
    oct<T>(W + (size_t)row * row_bytes, u, p, w);
    __half2 h[4], l[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        h[k] = __floats2half2_rn(w[2 * k], w[2 * k + 1]);
        float2 b = __half22float2(h[k]);
        l[k] = __floats2half2_rn((w[2 * k] - b.x) * 2048.f, (w[2 * k + 1] - b.y) * 2048.f);
    }
    long k = 32L * units, at = (long)row * 2 * k + (long)u * 32 + 8 * p;     // halves
    *reinterpret_cast<uint4*>(out + at) = *reinterpret_cast<uint4*>(h);
    *reinterpret_cast<uint4*>(out + at + k) = *reinterpret_cast<uint4*>(l);
}

#define KERNELS(T, NAME) \
extern "C" __global__ void dequant_##NAME(const u8* W, float* out, int n, int units, long rb) \
    { dequant<T>(W, out, n, units, rb); } \
extern "C" __global__ void dequant16_##NAME(const u8* W, __half* out, int n, int units, long rb) \
    { dequant_half<T>(W, out, n, units, rb); } \
extern "C" __global__ void dequant_split_##NAME(const u8* W, __half* out, int n, int units, long rb) \
    { dequant_split<T>(W, out, n, units, rb); }
KERNELS(0, q4_0)
KERNELS(1, q4_1)
KERNELS(2, q8_0)
KERNELS(3, q4_k)
KERNELS(4, q6_k)
KERNELS(5, q6_kr)
