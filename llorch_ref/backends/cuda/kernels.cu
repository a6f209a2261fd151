#include <cuda_fp16.h>
// y[n] = sum_k W[n, k] x[k], float32 accumulation: one warp per row (scalar loads, or 8 halves at a time), or
// for float32 rows whose length is a multiple of 4, a block per row (gemv_f32_row).
template <typename T>
__device__ void gemv(const T* W, const float* x, float* y, int n, int k) {
    int row = blockIdx.x * 8 + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    if (row >= n) return;
    const T* w = W + (size_t)row * k;
    float acc = 0.f;
    for (int i = lane; i < k; i += 32) acc += (float)w[i] * x[i];
    for (int off = 16; off > 0; off >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, off);
    if (lane == 0) y[row] = acc;
}
extern "C" __global__ void gemv_f32(const float* W, const float* x, float* y, int n, int k) { gemv<float>(W, x, y, n, k); }
extern "C" __global__ void gemv_f16(const __half* W, const float* x, float* y, int n, int k) { gemv<__half>(W, x, y, n, k); }

extern "C" __global__ void gemv_f32_row(const float* __restrict__ W, const float* __restrict__ x,
                                        float* __restrict__ y, int n, int k) {   // k % 4 == 0; 128 threads a row
    int row = blockIdx.x, tid = threadIdx.x;
    const float4* w = reinterpret_cast<const float4*>(W + (size_t)row * k);
    const float4* xv = reinterpret_cast<const float4*>(x);
    float a[4] = {0.f, 0.f, 0.f, 0.f};
    int k4 = k / 4, i = tid;
    for (; i + 384 < k4; i += 512) {          // the block reads 8 KB of the row per step, 4 loads a thread
        float4 p[4], u[4];
#pragma unroll
        for (int r = 0; r < 4; ++r) { p[r] = __ldcs(w + i + 128 * r); u[r] = __ldg(xv + i + 128 * r); }
#pragma unroll
        for (int r = 0; r < 4; ++r) a[r] += p[r].x * u[r].x + p[r].y * u[r].y + p[r].z * u[r].z + p[r].w * u[r].w;
    }
    for (; i < k4; i += 128) { float4 p = __ldcs(w + i), u = __ldg(xv + i); a[0] += p.x * u.x + p.y * u.y + p.z * u.z + p.w * u.w; }
    float acc = (a[0] + a[1]) + (a[2] + a[3]);
    for (int off = 16; off > 0; off >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, off);
    __shared__ float part[4];
    if (tid % 32 == 0) part[tid / 32] = acc;
    __syncthreads();
    if (tid == 0) y[row] = (part[0] + part[1]) + (part[2] + part[3]);
}

extern "C" __global__ void gemv_f16_v8(const __half* __restrict__ W, const float* __restrict__ x,
                                       float* __restrict__ y, int n, int k) {  // k % 8 == 0
    int row = blockIdx.x * 8 + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    if (row >= n) return;
    const uint4* w = reinterpret_cast<const uint4*>(W + (size_t)row * k);
    const float4* xv = reinterpret_cast<const float4*>(x);
    float a[2] = {0.f, 0.f};
    int k8 = k / 8, i = lane;
    for (; i < k8; i += 64) {                 // two independent 16-byte weight loads in flight per lane
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            int c = i + 32 * r;
            if (c < k8) {
                uint4 raw = __ldcs(w + c);
                const __half2* h = reinterpret_cast<const __half2*>(&raw);
                float4 u = __ldg(xv + 2 * c), v = __ldg(xv + 2 * c + 1);
                float2 f0 = __half22float2(h[0]), f1 = __half22float2(h[1]), f2 = __half22float2(h[2]), f3 = __half22float2(h[3]);
                a[r] += f0.x * u.x + f0.y * u.y + f1.x * u.z + f1.y * u.w + f2.x * v.x + f2.y * v.y + f3.x * v.z + f3.y * v.w;
            }
        }
    }
    float acc = a[0] + a[1];
    for (int off = 16; off > 0; off >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, off);
    if (lane == 0) y[row] = acc;
}

// The same product with four 16-byte weight loads issued before any is used (more bytes in flight per
// lane), a warp per row, 4 rows a block of 128 threads.
extern "C" __global__ void gemv_f16_x4(const __half* __restrict__ W, const float* __restrict__ x,
                                       float* __restrict__ y, int n, int k) {  // k % 8 == 0
    int row = blockIdx.x * 4 + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    if (row >= n) return;
    const uint4* w = reinterpret_cast<const uint4*>(W + (size_t)row * k);
    const float4* xv = reinterpret_cast<const float4*>(x);
    float a[4] = {0.f, 0.f, 0.f, 0.f};
    int k8 = k / 8, i = lane;
    for (; i + 96 < k8; i += 128) {
        uint4 raw[4];
#pragma unroll
        for (int r = 0; r < 4; ++r) raw[r] = __ldcs(w + i + 32 * r);
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            int c = i + 32 * r;
            const __half2* h = reinterpret_cast<const __half2*>(&raw[r]);
            float4 u = __ldg(xv + 2 * c), v = __ldg(xv + 2 * c + 1);
            float2 f0 = __half22float2(h[0]), f1 = __half22float2(h[1]), f2 = __half22float2(h[2]), f3 = __half22float2(h[3]);
            a[r] += f0.x * u.x + f0.y * u.y + f1.x * u.z + f1.y * u.w + f2.x * v.x + f2.y * v.y + f3.x * v.z + f3.y * v.w;
        }
    }
    for (; i < k8; i += 32) {
        uint4 raw = __ldcs(w + i);
        const __half2* h = reinterpret_cast<const __half2*>(&raw);
        float4 u = __ldg(xv + 2 * i), v = __ldg(xv + 2 * i + 1);
        float2 f0 = __half22float2(h[0]), f1 = __half22float2(h[1]), f2 = __half22float2(h[2]), f3 = __half22float2(h[3]);
        a[0] += f0.x * u.x + f0.y * u.y + f1.x * u.z + f1.y * u.w + f2.x * v.x + f2.y * v.y + f3.x * v.z + f3.y * v.w;
    }
    float acc = (a[0] + a[1]) + (a[2] + a[3]);
    for (int off = 16; off > 0; off >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, off);
    if (lane == 0) y[row] = acc;
}

// An element stored as float32, or rounded to float16 (a float16 cache, or the input of a float16 product).
__device__ __forceinline__ void put(float* c, float v) { *c = v; }
__device__ __forceinline__ void put(__half* c, float v) { *c = __float2half_rn(v); }

// A decode step's K and V rows into the cache at the device-side position (one launch for both).
template <typename C> __device__ void kv_store(const float* k, const float* v, C* kc, C* vc, const long long* pos, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) { size_t at = (size_t)pos[0] * n + i; put(kc + at, k[i]); put(vc + at, v[i]); }
}
extern "C" __global__ void kv_store_f32(const float* k, const float* v, float* kc, float* vc, const long long* pos,
                                        int n) { kv_store(k, v, kc, vc, pos, n); }
extern "C" __global__ void kv_store_f16(const float* k, const float* v, __half* kc, __half* vc, const long long* pos,
                                        int n) { kv_store(k, v, kc, vc, pos, n); }

// out[0] = the index of the highest of x[0..n) as np.argmax answers: NaN above everything, the first index on ties
// (one block of 1024 threads: strided scans, then a tree of pairwise choices).
__device__ __forceinline__ bool ahead(float a, int ia, float b, int ib) {
    bool an = a != a, bn = b != b;
    if (an != bn) return an;
    if (!an && a != b) return a > b;
    return ia < ib;
}
__device__ __forceinline__ int argmax_block(const float* x, int n) {
    __shared__ float bv[1024];
    __shared__ int bi[1024];
    float v = __int_as_float(0xff800000);
    int iv = n;
    for (int i = threadIdx.x; i < n; i += blockDim.x) if (iv == n || ahead(x[i], i, v, iv)) { v = x[i]; iv = i; }
    bv[threadIdx.x] = v; bi[threadIdx.x] = iv;
    __syncthreads();
    for (int o = blockDim.x / 2; o > 0; o >>= 1) {
        if (threadIdx.x < o && bi[threadIdx.x + o] < n &&
            (bi[threadIdx.x] == n || ahead(bv[threadIdx.x + o], bi[threadIdx.x + o], bv[threadIdx.x], bi[threadIdx.x]))) {
            bv[threadIdx.x] = bv[threadIdx.x + o]; bi[threadIdx.x] = bi[threadIdx.x + o];
        }
        __syncthreads();
    }
    return bi[0];
}
extern "C" __global__ void argmax_row(const float* x, int n, long long* out) {
    int best = argmax_block(x, n);
    if (threadIdx.x == 0) out[0] = best;
}
// a decode step's argmax (after its position was advanced to pos): the next step's input token, and ring slot
// pos % ring for the host to read while a later step runs
extern "C" __global__ void argmax_feed(const float* x, int n, long long* tok, long long* ring, int ring_n,
                                       const long long* pos) {
    int best = argmax_block(x, n);
    if (threadIdx.x == 0) { tok[0] = best; ring[pos[0] % ring_n] = best; }
}

// softmax(kq * scale + mask) of each row of S scores (one block of 256 threads per row; row r of head r / T,
// token r % T): the reference's float32 operations, each rounded (no fused multiply-add), max, expf, the sum in
// float64, then e * (float)(1 / sum) (e computed again, the same expf, rather than stored and read back).
__device__ __forceinline__ float softmax_e(const float* row, const float* mk, int j, float scale, float m) {
    return expf(__fsub_rn(__fadd_rn(__fmul_rn(row[j], scale), mk[j]), m));
}
template <typename O>
__device__ void softmax_row(const float* kq, const float* mask, O* probs, float scale, int S, int T) {
    __shared__ float redf[256];
    __shared__ double redd[256];
    const float* row = kq + (size_t)blockIdx.x * S;
    const float* mk = mask + (size_t)(blockIdx.x % T) * S;
    O* out = probs + (size_t)blockIdx.x * S;
    float m = __int_as_float(0xff800000);
    for (int j = threadIdx.x; j < S; j += blockDim.x) m = fmaxf(m, __fadd_rn(__fmul_rn(row[j], scale), mk[j]));
    redf[threadIdx.x] = m;
    __syncthreads();
    for (int o = blockDim.x / 2; o > 0; o >>= 1) {
        if (threadIdx.x < o) redf[threadIdx.x] = fmaxf(redf[threadIdx.x], redf[threadIdx.x + o]);
        __syncthreads();
    }
    m = redf[0];
    double z = 0.0;
    for (int j = threadIdx.x; j < S; j += blockDim.x) z += (double)softmax_e(row, mk, j, scale, m);
    redd[threadIdx.x] = z;
    __syncthreads();
    for (int o = blockDim.x / 2; o > 0; o >>= 1) {
        if (threadIdx.x < o) redd[threadIdx.x] += redd[threadIdx.x + o];
        __syncthreads();
    }
    float inv = (float)(1.0 / redd[0]);
    for (int j = threadIdx.x; j < S; j += blockDim.x) put(out + j, __fmul_rn(softmax_e(row, mk, j, scale, m), inv));
}
extern "C" __global__ void softmax_rows(const float* kq, const float* mask, float* probs, float scale, int S, int T) {
    softmax_row(kq, mask, probs, scale, S, T);
}
extern "C" __global__ void softmax_rows_f16(const float* kq, const float* mask, __half* probs, float scale, int S,
                                            int T) {
    softmax_row(kq, mask, probs, scale, S, T);
}

// RMSNorm of each row of n values (one block of 256 threads per row): sum of squares in float64 as the NumPy
// reference, mean and root in float32, y = (x * (1 / sqrt(mean + eps))) * w. With a (add_rms_norm_*): the row is
// s = x + a (float32, written out: the residual stream) and y its RMSNorm, one pass for the two operations.
template <typename O>
__device__ void norm_row(const float* x, const float* a, float* s, const float* w, O* y, int n, float eps) {
    __shared__ double part[256];
    size_t at = (size_t)blockIdx.x * n;
    const float* xr = (a ? s : x) + at;                     // the normed row (s once written)
    double acc = 0.0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        float v = x[at + i];
        if (a) { v = __fadd_rn(v, a[at + i]); s[at + i] = v; }
        acc += (double)(v * v);
    }
    part[threadIdx.x] = acc;
    __syncthreads();
    for (int off = blockDim.x / 2; off > 0; off >>= 1) {
        if (threadIdx.x < off) part[threadIdx.x] += part[threadIdx.x + off];
        __syncthreads();
    }
    float mean = (float)(part[0] / n);
    float scale = 1.0f / sqrtf(mean + eps);
    for (int i = threadIdx.x; i < n; i += blockDim.x) put(y + at + i, (xr[i] * scale) * w[i]);   // own writes
}
extern "C" __global__ void rms_norm_rows(const float* x, const float* w, float* y, int n, float eps) {
    norm_row(x, (const float*)0, (float*)0, w, y, n, eps);
}
extern "C" __global__ void rms_norm_rows_f16(const float* x, const float* w, __half* y, int n, float eps) {
    norm_row(x, (const float*)0, (float*)0, w, y, n, eps);
}
extern "C" __global__ void add_rms_norm_f32(const float* x, const float* a, float* s, const float* w, float* y, int n,
                                            float eps) {
    norm_row(x, a, s, w, y, n, eps);
}
extern "C" __global__ void add_rms_norm_f16(const float* x, const float* a, float* s, const float* w, __half* y, int n,
                                            float eps) {
    norm_row(x, a, s, w, y, n, eps);
}

// The gated activations: g and u [T, F] rows ld floats apart (the two halves of the stacked gate/up product, or two
// arrays), h [T, F] = act(g) * u in float32 (silu, or gelu's tanh form), stored as float32 (glu_f32) or rounded to
// float16 for the down product that would round it so (glu_f16). One thread per element, grid-stride.
template <typename O>
__device__ void glu(const float* g, const float* u, long long ld, O* h, int F, long long n, int gelu) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        long long at = (i / F) * ld + i % F;
        float gv = g[at], uv = u[at];
        float a = gelu ? (0.5f * gv * (1.0f + tanhf(0.7978845608028654f * (gv + 0.044715f * gv * gv * gv))))
                       : (gv / (1.0f + expf(-gv)));
        put(h + i, a * uv);
    }
}
extern "C" __global__ void glu_f32(const float* g, const float* u, long long ld, float* h, int F, long long n,
                                   int gelu) {
    glu(g, u, ld, h, F, n, gelu);
}
extern "C" __global__ void glu_f16(const float* g, const float* u, long long ld, __half* h, int F, long long n,
                                   int gelu) {
    glu(g, u, ld, h, F, n, gelu);
}

// The device-side position a decode step read, advanced by the step's last kernel (inside its CUDA graph).
extern "C" __global__ void bump_pos(long long* pos) { pos[0] += 1; }

// A pair's rotation, each product and difference rounded as NumPy rounds them (no contraction into an FMA):
// y0 = x0 c - x1 s, y1 = x0 s + x1 c.
__device__ __forceinline__ float rot0(float x0, float x1, float c, float s) { return __fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, s)); }
__device__ __forceinline__ float rot1(float x0, float x1, float c, float s) { return __fadd_rn(__fmul_rn(x0, s), __fmul_rn(x1, c)); }

// RoPE: x [T, nh, hd], cos/sin [T, half] (half = rotated dims / 2); neox: pairs (i, i + half),
// adjacent: pairs (2i, 2i + 1); dims past 2 * half are copied. One thread per pair or copied dim.
extern "C" __global__ void rope_rows(const float* x, const float* cs, const float* sn, float* y, int T, int nh,
                                     int hd, int half, int neox, long long stride) {
    long idx = (long)blockIdx.x * blockDim.x + threadIdx.x;
    int per = hd - half;                                   // pairs + copied dims per head
    if (idx >= (long)T * nh * per) return;
    int t = idx / (nh * per), rem = idx % (nh * per);
    int h = rem / per, i = rem % per;
    const float* xh = x + (size_t)t * stride + (size_t)h * hd;     // token rows `stride` floats apart
    float* yh = y + ((size_t)t * nh + h) * hd;
    if (i < half) {
        int a = neox ? i : 2 * i, b = neox ? i + half : 2 * i + 1;
        float x0 = xh[a], x1 = xh[b], c = cs[t * half + i], s = sn[t * half + i];
        yh[a] = rot0(x0, x1, c, s);
        yh[b] = rot1(x0, x1, c, s);
    } else {
        int d = 2 * half + (i - half);
        yh[d] = xh[d];
    }
}

// Generation's prefill (no recorder watching): RoPE of the T new tokens' q and k read straight from the stacked
// Q/K/V product y (token rows ys floats apart: q at 0, k at H hd, v at (H + KV) hd), k and v written into this
// layer's cache rows pos.. (type C), and q, k, v as float16 in head-major order for the attention's batched
// products: q16 [H, T, hd], k16, v16 [KV, S, hd] at rows pos... The rotation is rope_rows's to the bit. One thread
// per (token, head of q, k or v, dim).
template <typename C>
__device__ void rope_store(const float* y, long long ys, const float* cs, const float* sn, C* kc, C* vc, __half* q16,
                           __half* k16, __half* v16, int T, int H, int KV, int hd, int half, int neox, int pos, int S) {
    long idx = (long)blockIdx.x * blockDim.x + threadIdx.x;
    int heads = H + 2 * KV;
    if (idx >= (long)T * heads * hd) return;
    int t = idx / (heads * hd), rem = idx % (heads * hd), hh = rem / hd, d = rem % hd;
    const float* xh = y + (size_t)t * ys + (size_t)hh * hd;
    float val = xh[d];
    if (hh < H + KV && d < 2 * half) {                       // q or k, a rotated dim: its pair's formula
        int i = neox ? (d < half ? d : d - half) : d / 2;
        bool first = neox ? d < half : d % 2 == 0;
        int a = neox ? i : 2 * i, b = neox ? i + half : 2 * i + 1;
        float c = cs[t * half + i], s = sn[t * half + i];
        val = first ? rot0(xh[a], xh[b], c, s) : rot1(xh[a], xh[b], c, s);
    }
    if (hh < H) { q16[((size_t)hh * T + t) * hd + d] = __float2half_rn(val); return; }
    bool is_k = hh < H + KV;
    int kvh = is_k ? hh - H : hh - H - KV;
    put((is_k ? kc : vc) + ((size_t)(pos + t) * KV + kvh) * hd + d, val);
    (is_k ? k16 : v16)[((size_t)kvh * S + pos + t) * hd + d] = __float2half_rn(val);
}
extern "C" __global__ void rope_store_f32(const float* y, long long ys, const float* cs, const float* sn, float* kc,
                                          float* vc, __half* q16, __half* k16, __half* v16, int T, int H, int KV,
                                          int hd, int half, int neox, int pos, int S) {
    rope_store(y, ys, cs, sn, kc, vc, q16, k16, v16, T, H, KV, hd, half, neox, pos, S);
}
extern "C" __global__ void rope_store_f16(const float* y, long long ys, const float* cs, const float* sn, __half* kc,
                                          __half* vc, __half* q16, __half* k16, __half* v16, int T, int H, int KV,
                                          int hd, int half, int neox, int pos, int S) {
    rope_store(y, ys, cs, sn, kc, vc, q16, k16, v16, T, H, KV, hd, half, neox, pos, S);
}

// Attention, one block of 1024 threads per (query head, query token). q [T, H, hd]; k, v [S, KV, hd];
// mask [T, S] (0 or -inf). Writes kq [H, T, S] (raw q.k everywhere with all_dots, else 0 where masked: masked
// keys are then not read),
// probs [H, T, S] (softmax of kq * scale + mask: max, exp in float32, sum in float64 as the reference) and
// out [T, H * hd].
// The mask is staged in shared memory first, so masked positions cost no global load; P.V is split over
// groups of threads (hd threads each) and the groups' sums added in a fixed order.
extern "C" __global__ void attend(const float* q, const float* k, const float* v, const float* mask,
                                  float* kq, float* probs, float* out, int T, int S, int H, int KV, int hd,
                                  float scale, int all_dots) {
    extern __shared__ float p[];                 // [S] scores, then probabilities; then [groups * hd] partials
    __shared__ float red[32];
    __shared__ double redd[32];
    const float NEG_INF = __int_as_float(0xff800000);
    int h = blockIdx.x, t = blockIdx.y, kvh = h / (H / KV);
    int nw = blockDim.x / 32, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const float* qh = q + ((size_t)t * H + h) * hd;
    mask += (size_t)t * S;
    kq += ((size_t)h * T + t) * S;
    probs += ((size_t)h * T + t) * S;
    out += ((size_t)t * H + h) * hd;
    __shared__ int seen_end;                     // 1 + the last visible position: nothing past it is read
    if (threadIdx.x == 0) seen_end = 0;
    for (int j = threadIdx.x; j < S; j += blockDim.x) p[j] = mask[j];
    __syncthreads();
    int my_end = 0;
    for (int j = threadIdx.x; j < S; j += blockDim.x) if (p[j] == 0.f) my_end = j + 1;
    atomicMax(&seen_end, my_end);
    __syncthreads();
    const int L = all_dots ? S : seen_end;       // a decode step over a long preallocated cache stops at L
    for (int j = L + threadIdx.x; j < S; j += blockDim.x) { kq[j] = 0.f; probs[j] = 0.f; }
    for (int j = warp; j < L; j += nw) {         // one warp per key position: coalesced rows
        float acc = 0.f;
        bool seen = p[j] == 0.f;
        if (seen || all_dots) {
            const float* kj = k + ((size_t)j * KV + kvh) * hd;
            for (int d = lane; d < hd; d += 32) acc += qh[d] * kj[d];
            for (int off = 16; off > 0; off >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, off);
        }
        if (lane == 0) {
            kq[j] = acc;
            p[j] = seen ? acc * scale : NEG_INF;
        }
    }
    __syncthreads();
    float m = NEG_INF;
    for (int j = threadIdx.x; j < L; j += blockDim.x) m = fmaxf(m, p[j]);
    for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_down_sync(0xffffffffu, m, off));
    if (lane == 0) red[warp] = m;
    __syncthreads();
    m = red[0];
    for (int w = 1; w < nw; ++w) m = fmaxf(m, red[w]);
    double z = 0.0;
    for (int j = threadIdx.x; j < L; j += blockDim.x) { float e = expf(p[j] - m); p[j] = e; z += (double)e; }
    for (int off = 16; off > 0; off >>= 1) z += __shfl_down_sync(0xffffffffu, z, off);
    if (lane == 0) redd[warp] = z;
    __syncthreads();
    z = 0.0;
    for (int w = 0; w < nw; ++w) z += redd[w];
    float inv = (float)(1.0 / z);
    for (int j = threadIdx.x; j < L; j += blockDim.x) { p[j] = p[j] * inv; probs[j] = p[j]; }
    __syncthreads();
    float* part = p + S;                         // [groups, hd]
    int groups = blockDim.x / hd;
    int g = threadIdx.x / hd, d = threadIdx.x % hd;
    if (g < groups) {
        float acc = 0.f;
        for (int j = g; j < L; j += groups)
            if (p[j] != 0.f) acc += p[j] * v[((size_t)j * KV + kvh) * hd + d];
        part[g * hd + d] = acc;
    }
    __syncthreads();
    for (int dd = threadIdx.x; dd < hd; dd += blockDim.x) {
        float acc = 0.f;
        for (int gg = 0; gg < groups; ++gg) acc += part[gg * hd + dd];
        out[dd] = acc;
    }
}
