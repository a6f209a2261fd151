// P (the products) or pl (rope_attend, embed): the vectors the products read (the residual stream x, the attention
// output, the gated activation, the norms' weights) are kept in rows_dot's planar layout: every kernel that writes
// one writes its planar places.
// hid[i] = silu(r * gate_i . (x g)) * (r * up_i . (x g)), gate row i and up row f + i of W [2f, k] by W warps.
template <typename F, int U, int W, bool P>
__device__ void norm_glu(const u8* Wm, const float* x, const float* g, float* hid, int f, int k, long rb, float eps) {
    int row = blockIdx.x * (4 / W) + threadIdx.x / 32 / W, at = min(row, f - 1);
    const u8* w[2] = {Wm + (size_t)at * rb, Wm + (size_t)(f + at) * rb};
    float dot[2], ss;
    rows_dot<F, U, 2, true, W, P>(w, reinterpret_cast<const float4*>(x), reinterpret_cast<const float4*>(g), k / 8,
                                       dot, ss);
    if (threadIdx.x % (32 * W) == 0 && row < f) {
        float r = 1.0f / sqrtf(ss / k + eps), gate = dot[0] * r, up = dot[1] * r;
        hid[P ? planar(row, f) : row] = (gate / (1.0f + expf(-gate))) * up;
    }
}
