__device__ __forceinline__ void put(float* c, float v) { *c = v; }
__device__ __forceinline__ void put(__half* c, float v) { *c = __float2half_rn(v); }
__device__ __forceinline__ float get(const float* c) { return *c; }
__device__ __forceinline__ float get(const __half* c) { return __half2float(*c); }

__device__ __forceinline__ float4 load4(const float* c) { return *reinterpret_cast<const float4*>(c); }
__device__ __forceinline__ float4 load4(const __half* c) {
    uint2 raw = *reinterpret_cast<const uint2*>(c);
    const __half2* h = reinterpret_cast<const __half2*>(&raw);
    float2 a = __half22float2(h[0]), b = __half22float2(h[1]);
    return make_float4(a.x, a.y, b.x, b.y);
}
__device__ __forceinline__ float rnd(const float*, float v) { return v; }
__device__ __forceinline__ float rnd(const __half*, float v) { return __half2float(__float2half_rn(v)); }

// RoPE, the K/V store and attention of one token: a block per query head for up to ATTEND_ONE key positions, past
// that a block per head and chunk of ATTEND_CHUNK positions (flash-decoding: a long context spreads over the card
// instead of one block a head; blocks past the context exit).
// y = [q (H*hd), k (KV*hd), v (KV*hd)]; cos/sin: the [n_ctx, half] tables (neox pairs (i, i + half), else (2i,
// 2i + 1); dims past 2 half copied); the cache rows at pos are written by chunk 0 of the first query head of each KV
// head, while every block reads positions before pos from the cache and its own rotated k and v (rounded as the
// cache stores them) at pos. Scores (a warp per position), softmax (max, exp, sum), P.V (a warp per position, four
// dims a lane), the warps' sums added in a fixed order; out [H * hd]; hd % 4 == 0. One chunk: out = acc / sum. Several: each block leaves (max, sum, acc) in part, and the head's last
// block to finish (a counter per head, reset by it) rescales them to the largest max and writes out.
template <typename C>
__device__ void rope_attend(const float* y, const float* cs, const float* sn, const long long* pos, C* kc, C* vc,
                            float* out, float* part, int* count, int H, int KV, int hd, int half, int neox,
                            float scale, int pl) {
    extern __shared__ float sm[];                // q [hd], k [hd], v [hd], p [ATTEND_ONE], partials [warps * hd]
    __shared__ float red[32];
    __shared__ int last;
    griddep_wait();
    int h = blockIdx.x, grp = H / KV, kvh = h / grp;
    long long P = pos[0];
    int L = (int)P + 1, ns = L <= ATTEND_ONE ? 1 : (L + ATTEND_CHUNK - 1) / ATTEND_CHUNK, ch = blockIdx.y;
    if (ch >= ns) return;
    int j0 = ch * ATTEND_CHUNK, j1 = ns == 1 ? L : min(L, j0 + ATTEND_CHUNK);
    int nw = blockDim.x / 32, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    float *qs = sm, *kn = sm + hd, *vn = sm + 2 * hd, *p = sm + 3 * hd;
    const float *yq = y + (size_t)h * hd, *yk = y + (size_t)(H + kvh) * hd, *yv = y + (size_t)(H + KV + kvh) * hd;
    const C* c0 = nullptr;
    for (int i = threadIdx.x; i < hd - half; i += blockDim.x) {
        if (i < half) {
            int a = neox ? i : 2 * i, b = neox ? i + half : 2 * i + 1;
            float c = cs[P * half + i], s = sn[P * half + i];
            float q0 = yq[a], q1 = yq[b], k0 = yk[a], k1 = yk[b];
            qs[a] = q0 * c - q1 * s; qs[b] = q0 * s + q1 * c;
            kn[a] = rnd(c0, k0 * c - k1 * s); kn[b] = rnd(c0, k0 * s + k1 * c);
        } else {
            int d = 2 * half + (i - half);
            qs[d] = yq[d]; kn[d] = rnd(c0, yk[d]);
        }
    }
    for (int i = threadIdx.x; i < hd; i += blockDim.x) vn[i] = rnd(c0, yv[i]);
    __syncthreads();
    if (ch == 0 && h % grp == 0)
        for (int i = threadIdx.x; i < hd; i += blockDim.x) {
            size_t at = ((size_t)P * KV + kvh) * hd + i;
            put(kc + at, kn[i]); put(vc + at, vn[i]);
        }
    for (int j = j0 + warp; j < j1; j += nw) {   // one warp per key position
        float acc = 0.f;
        if (j < P) {
            const C* kj = kc + ((size_t)j * KV + kvh) * hd;
            for (int d = lane; d < hd; d += 32) acc += qs[d] * get(kj + d);
        } else {
            for (int d = lane; d < hd; d += 32) acc += qs[d] * kn[d];
        }
        acc = warp_sum(acc);
        if (lane == 0) p[j - j0] = acc * scale;
    }
    __syncthreads();
    float m = __int_as_float(0xff800000);
    for (int j = threadIdx.x; j < j1 - j0; j += blockDim.x) m = fmaxf(m, p[j]);
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    if (lane == 0) red[warp] = m;
    __syncthreads();
    int used = min(nw, j1 - j0);                 // warps that had a position (the others' sums are zeros)
    m = red[0];
    for (int w = 1; w < used; ++w) m = fmaxf(m, red[w]);
    __syncthreads();
    float z = 0.f;
    for (int j = threadIdx.x; j < j1 - j0; j += blockDim.x) { float e = expf(p[j] - m); p[j] = e; z += e; }
    z = warp_sum(z);
    if (lane == 0) red[warp] = z;
    __syncthreads();
    z = 0.f;
    for (int w = 0; w < used; ++w) z += red[w];
    float* pw = p + ATTEND_ONE;                  // P.V: warp w sums positions w, w + nw, ...; lane l dims 4l + 128r
    for (int d0 = 4 * lane; d0 < hd; d0 += 128) {
        float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
        for (int j = j0 + warp; j < j1; j += nw) {
            float4 u = j < P ? load4(vc + ((size_t)j * KV + kvh) * hd + d0) : *reinterpret_cast<const float4*>(vn + d0);
            float e = p[j - j0];
            acc.x += e * u.x; acc.y += e * u.y; acc.z += e * u.z; acc.w += e * u.w;
        }
        *reinterpret_cast<float4*>(pw + warp * hd + d0) = acc;
    }
    __syncthreads();
    if (ns == 1) {
        float inv = 1.0f / z;
        for (int dd = threadIdx.x; dd < hd; dd += blockDim.x) {
            float acc = 0.f;
            for (int w = 0; w < used; ++w) acc += pw[w * hd + dd];
            out[pl ? planar(h * hd + dd, H * hd) : h * hd + dd] = acc * inv;
        }
        return;
    }
    float* mine = part + ((size_t)h * gridDim.y + ch) * (hd + 2);      // [max, sum, acc (hd)]
    for (int dd = threadIdx.x; dd < hd; dd += blockDim.x) {
        float acc = 0.f;
        for (int w = 0; w < used; ++w) acc += pw[w * hd + dd];
        mine[2 + dd] = acc;
    }
    if (threadIdx.x == 0) { mine[0] = m; mine[1] = z; }
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(count + h, 1) == ns - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    const float* all = part + (size_t)h * gridDim.y * (hd + 2);
    float M = __int_as_float(0xff800000), Z = 0.f;
    for (int t = 0; t < ns; ++t) M = fmaxf(M, __ldcg(all + (size_t)t * (hd + 2)));
    for (int t = 0; t < ns; ++t) Z += __ldcg(all + (size_t)t * (hd + 2) + 1) * expf(__ldcg(all + (size_t)t * (hd + 2)) - M);
    float inv = 1.0f / Z;
    for (int dd = threadIdx.x; dd < hd; dd += blockDim.x) {
        float acc = 0.f;
        for (int t = 0; t < ns; ++t)
            acc += __ldcg(all + (size_t)t * (hd + 2) + 2 + dd) * expf(__ldcg(all + (size_t)t * (hd + 2)) - M);
        out[pl ? planar(h * hd + dd, H * hd) : h * hd + dd] = acc * inv;
    }
    if (threadIdx.x == 0) count[h] = 0;
}
extern "C" __global__ void rope_attend_f32(const float* y, const float* cs, const float* sn, const long long* pos,
                                           float* kc, float* vc, float* out, float* part, int* count, int H, int KV,
                                           int hd, int half, int neox, float scale, int pl) {
    rope_attend(y, cs, sn, pos, kc, vc, out, part, count, H, KV, hd, half, neox, scale, pl);
}
extern "C" __global__ void rope_attend_f16(const float* y, const float* cs, const float* sn, const long long* pos,
                                           __half* kc, __half* vc, float* out, float* part, int* count, int H, int KV,
                                           int hd, int half, int neox, float scale, int pl) {
    rope_attend(y, cs, sn, pos, kc, vc, out, part, count, H, KV, hd, half, neox, scale, pl);
}

// x = emb[tok] * scale (float32 or float16 rows; pl: x planar)
template <typename T> __device__ void embed(const T* emb, const long long* tok, float* x, int d, float scale, int pl) {
    griddep_wait();
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < d) x[pl ? planar(i, d) : i] = get(emb + (size_t)tok[0] * d + i) * scale;
}
extern "C" __global__ void embed_f32(const float* e, const long long* t, float* x, int d, float s, int pl) {
    embed(e, t, x, d, s, pl);
}
extern "C" __global__ void embed_f16(const __half* e, const long long* t, float* x, int d, float s, int pl) {
    embed(e, t, x, d, s, pl);
}
