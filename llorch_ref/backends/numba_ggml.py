"""numerics "ggml" on the numba backend: llama.cpp's CPU arithmetic for a one-token step, in numba, bit for bit
numerics.ggml_cpu's NumPy emulation (checked against llama.cpp's tensors there) with no NumPy call per operation.

Each function mirrors one of ggml_cpu's: the float32 fused multiply-add emulated in float64 (`_fma`), ggml_v_expf
with its integer tricks (`v_expf`), Q8_0/Q8_1 activation quantization (`quantize_q8`), the FMA-contracted RoPE,
ggml_vec_dot_f32's 4 accumulators of `lanes` (`_fold`), the softmax in chunks of `lanes` with a float64 total, and one-token
attention on a float32 or float16 K/V cache (kv_get/kv_put/kv_round: one code for both). `decode_step` runs every
layer of a llama step in one call, its products by numba_kernels.ggml_rows on the file's blocks (Q/K/V and gate/up
stacked by rows: each row's result is its own), in the order ops.block runs them. RMSNorm sums its squares in float64 in order, as ggml does.
`lanes` is the build's float32 lanes (ggml_cpu.SIMD_LANES: 8 for AVX2, 16 for AVX-512, whose v_expf differs too).
"""
from __future__ import annotations

import math

from . import numba_wide_vectors

numba_wide_vectors()            # before numba reads its configuration: 512-bit vectors on AVX-512 CPUs

import numba as nb  # noqa: E402
import numpy as np  # noqa: E402
from llvmlite import ir  # noqa: E402
from numba import types  # noqa: E402
from numba.extending import intrinsic, overload  # noqa: E402

from . import numba_kernels as K  # noqa: E402
from . import numba_simd as S  # noqa: E402
from .numba_simd import f16_bits_to_f32, f32_bits, f32_from_bits, f32_to_f16_bits  # noqa: E402

Q4_K, Q5_K = S.TYPE_CODE["Q4_K"], S.TYPE_CODE["Q5_K"]
KQUANT_TYPES = S.KQUANT                         # the K-quants kquant_rows multiplies (numba_simd.kquant_block's)
IS_KQUANT = np.array([name in S.KQUANT for name in S.NAMES])          # by type code
BLOCK_BYTES = np.array([S.BLOCKS[name][1] for name in S.NAMES], np.int64)   # by type code
KQ_ROWS = 16                                    # rows a kquant_rows task takes (its accumulators allocated once)

F32 = np.float32
_R, _LOG2E = F32(float.fromhex("0x1.8p23")), F32(float.fromhex("0x1.715476p+0"))
_LN2HI, _LN2LO = F32(float.fromhex("0x1.62e4p-1")), F32(float.fromhex("0x1.7f7d1cp-20"))
_C0, _C1 = F32(float.fromhex("0x1.0e4020p-7")), F32(float.fromhex("0x1.573e2ep-5"))
_C2, _C3 = F32(float.fromhex("0x1.555e66p-3")), F32(float.fromhex("0x1.fffdb6p-2"))
_C4 = F32(float.fromhex("0x1.ffffecp-1"))
_ONE_BITS = 0x3F800000


@nb.njit(inline="always")
def _fma(a, b, c):
    """float32 fused multiply-add, emulated in float64 (ggml_cpu.fma)."""
    return np.float32(np.float64(a) * np.float64(b) + np.float64(c))


@nb.njit(inline="always")
def _f16(v):
    """A float32 rounded to the nearest float16, back as float32 (NumPy's astype(float16).astype(float32))."""
    return f16_bits_to_f32(f32_to_f16_bits(v))


@nb.njit(cache=True)
def v_expf(x, lanes):
    """ggml_v_expf for one float32 (ggml_cpu.v_expf, lane by lane; lanes 16: its AVX-512 form)."""
    if lanes == 16:
        return _v_expf_avx512(x)
    z = _fma(x, _LOG2E, _R)
    n = z - _R
    b = _fma(-n, _LN2LO, _fma(-n, _LN2HI, x))
    e = np.int32(np.int64(f32_bits(z)) << 23)
    k = f32_from_bits(np.int32(np.int64(e) + _ONE_BITS))
    u = b * b
    j = _fma(_fma(_fma(_C0, b, _C1), u, _fma(_C2, b, _C3)), u, _C4 * b)
    if abs(n) <= F32(126):
        return _fma(j, k, k)
    g = np.int64(-0x7E000000) if n <= F32(0) else np.int64(0)
    s1 = f32_from_bits(np.int32(g + 0x7F000000))
    if abs(n) > F32(192):
        return s1 * s1
    s2 = f32_from_bits(np.int32(np.int64(e) - g))
    return _fma(s2, j, s2) * s1


@nb.njit(cache=True)
def _v_expf_avx512(x):
    """ggml_cpu._v_expf_avx512 for one float32: fma(c4, b, 1) last, then j * 2^n rounded once (scalef)."""
    z = _fma(x, _LOG2E, _R)
    n = z - _R
    b = _fma(-n, _LN2LO, _fma(-n, _LN2HI, x))
    u = b * b
    j = _fma(_fma(_fma(_C0, b, _C1), u, _fma(_C2, b, _C3)), u, _fma(_C4, b, F32(1)))
    if abs(n) > F32(192):
        return F32(0) if n <= F32(0) else F32(np.inf)
    return np.float32(math.ldexp(np.float64(j), int(n)))


@nb.njit(cache=True)
def quantize_q8(x, q, d, s):
    """x: [B*32] f32 -> q: [B*32] int8, d, s: [B] f32 (ggml_cpu.quantize_q8: d = amax/127 and s = d * sum(q), both
    through float16; q = rint(x * 127/amax)). s is written for Q8_1 and harmless for Q8_0."""
    for blk in range(d.shape[0]):
        amax = F32(0)
        for j in range(32):
            amax = max(amax, abs(x[32 * blk + j]))
        inv = F32(127) / amax if amax != F32(0) else F32(0)
        total = F32(0)
        for j in range(32):
            v = np.rint(x[32 * blk + j] * inv)
            q[32 * blk + j] = np.int8(v)
            total += v
        dd = amax / F32(127)
        d[blk], s[blk] = _f16(dd), _f16(dd * total)


@nb.njit(parallel=True, cache=True)
def quantize_rows(x, q, d, s):
    """x: [T, B*32] f32 -> q: [T, B*32] int8, d, s: [T, B] f32: quantize_q8 row by row (a prompt's activations)."""
    for t in nb.prange(x.shape[0]):
        quantize_q8(x[t], q[t], d[t], s[t])


@nb.njit(parallel=True, cache=True)
def quantize_q8k_rows(x, q, d, bsums):
    """x: [T, NB*256] f32 -> q: int8 [T, NB*256], d: f32 [T, NB], bsums: int32 [T, NB, 16] (ggml_cpu.quantize_q8_k,
    quantize_row_q8_K_ref: iscale = -127 / the first value of largest magnitude, sign kept; q = rint(x * iscale)
    capped at 127; d = 1 / iscale; bsums: sums of 16), a token a thread."""
    for t in nb.prange(x.shape[0]):
        for b in range(d.shape[1]):
            o, mx, amax = 256 * b, F32(0), F32(0)
            for j in range(256):
                if abs(x[t, o + j]) > amax:
                    amax, mx = abs(x[t, o + j]), x[t, o + j]
            iscale = F32(-127) / mx if mx != F32(0) else F32(0)
            for g in range(16):
                total = 0
                for j in range(16 * g, 16 * g + 16):
                    v = np.int32(min(np.rint(x[t, o + j] * iscale), F32(127))) if mx != F32(0) else np.int32(0)
                    q[t, o + j] = np.int8(v)
                    total += v
                bsums[t, b, g] = total
            d[t, b] = F32(1) / iscale if mx != F32(0) else F32(0)


@nb.njit(parallel=True, cache=True)
def kquant_rows(code, rows, qa, da, bsums, out):
    """numerics "ggml": Q2_K..Q6_K rows (code: numba_simd.TYPE_CODE; rows: int64 [N] addresses of each row's
    super-blocks, the file's where they lie, as ggml_rows takes them) times Q8_K activations (quantize_q8k_rows) ->
    out [T, N] f32: ggml_cpu.KQuantMatrix's products bit for bit (ggml_vec_dot_qN_K_q8_K, AVX2: per super-block 8
    integer lanes, lane l = elements 4l..4l+3 of each 32-group times its scale, one FMA of d: numba_simd.kquant_block;
    Q4_K's mins through 4 lanes, Q5_K's one sum), then the lanes summed (hsum8), a row a thread."""
    t_n, n, nb_ = qa.shape[0], rows.shape[0], da.shape[1]
    size = BLOCK_BYTES[code]
    q8s = np.empty((t_n, nb_, 8), np.int32)            # Q8_K's sums per 32-group (the mins' partners), once
    for t in range(t_n):
        for b in range(nb_):
            for g in range(8):
                q8s[t, b, g] = bsums[t, b, 2 * g] + bsums[t, b, 2 * g + 1]
    chunks = (n + KQ_ROWS - 1) // KQ_ROWS
    for c in nb.prange(chunks):                        # KQ_ROWS rows a task: their accumulators allocated once
        acc, acc_m = np.empty((t_n, 8), F32), np.empty((t_n, 4), F32)      # Q5_K: acc_m[t, 0] its summs
        for r in range(c * KQ_ROWS, min(n, (c + 1) * KQ_ROWS)):
            acc[:] = 0
            acc_m[:] = 0
            _kquant_row(code, rows[r], rows[min(r + 1, n - 1)], size, qa, q8s, bsums, da, acc, acc_m)
            for t in range(t_n):
                y = _fold8(acc[t], 0)
                if code == Q4_K:
                    y = y + ((acc_m[t, 0] + acc_m[t, 2]) + (acc_m[t, 1] + acc_m[t, 3]))
                elif code == Q5_K:
                    y = y + acc_m[t, 0]
                out[t, r] = y


@nb.njit(inline="always")
def _kquant_row(code, row, ahead, size, qa, q8s, bsums, da, acc, acc_m):
    """One row's super-blocks (at address row) times every token (4 a call, the codes decoded once for them, then 1),
    into acc, acc_m; the next row's (ahead) prefetched a super-block at a time."""
    t_n, nb_ = qa.shape[0], da.shape[1]
    full = t_n - t_n % 4
    for b in range(nb_):
        S.prefetch(ahead + b * size, 192)
        for t in range(0, t_n):
            qa_t, q8_t = qa.ctypes.data + t * qa.shape[1] + 256 * b, q8s.ctypes.data + 32 * (t * nb_ + b)
            bs_t, da_t = bsums.ctypes.data + 64 * (t * nb_ + b), da.ctypes.data + 4 * (t * nb_ + b)
            if t < full and t % 4 == 0:
                S.kquant_block(code, 4, row + b * size, qa_t, q8_t, bs_t, da_t, acc.ctypes.data + 32 * t,
                               acc_m.ctypes.data + 16 * t, nb_)
            elif t >= full:
                S.kquant_block(code, 1, row + b * size, qa_t, q8_t, bs_t, da_t, acc.ctypes.data + 32 * t,
                               acc_m.ctypes.data + 16 * t, nb_)


@nb.njit(cache=True)
def product(code, rows, n_blocks, x):
    """x: [K] f32 -> [N] f32: the Q8 activations, then ggml_rows on the rows' blocks; for Q2_K..Q6_K the Q8_K
    activations, then kquant_rows."""
    out = np.empty((1, rows.shape[0]), F32)
    if IS_KQUANT[code]:
        q, d = np.empty((1, x.shape[0]), np.int8), np.empty((1, x.shape[0] // 256), F32)
        bsums = np.empty((1, x.shape[0] // 256, 16), np.int32)
        quantize_q8k_rows(x.reshape(1, -1), q, d, bsums)
        kquant_rows(code, rows, q, d, bsums, out)
        return out[0]
    n_b = x.shape[0] // 32
    q, d, s = np.empty((1, x.shape[0]), np.int8), np.empty((1, n_b), F32), np.empty((1, n_b), F32)
    quantize_q8(x, q[0], d[0], s[0])
    K.ggml_rows(code, rows, n_blocks, q, d, s, out)
    return out[0]


@nb.njit(cache=True)
def rope(x, cos, sin, neox):
    """x: [nh, Hd] f32 -> rotated copy (ggml_cpu.rope: y0 = fma(x0, c, -(x1 s)), y1 = fma(x0, s, x1 c))."""
    out = x.copy()
    half = cos.shape[0]
    for h in range(x.shape[0]):
        for i in range(half):
            i0, i1 = (i, i + half) if neox else (2 * i, 2 * i + 1)
            x0, x1 = x[h, i0], x[h, i1]
            out[h, i0] = _fma(x0, cos[i], -(x1 * sin[i]))
            out[h, i1] = _fma(x0, sin[i], x1 * cos[i])
    return out


# -- the K/V cache as float32, or float16 held as its bits (a uint16 view): the same code reads and writes both ------
def kv_get(a, s, g, d):
    """a[s, g, d] as float32."""


def kv_put(a, s, g, d, v):
    """a[s, g, d] = v (rounded to float16 for a float16 cache)."""


def kv_half(a):
    """Whether the cache holds float16 bits (a constant where numba compiles)."""


@overload(kv_get, inline="always")
def _kv_get(a, s, g, d):
    if a.dtype == types.uint16:
        return lambda a, s, g, d: f16_bits_to_f32(a[s, g, d])
    return lambda a, s, g, d: a[s, g, d]


@overload(kv_put, inline="always")
def _kv_put(a, s, g, d, v):
    if a.dtype == types.uint16:
        def put16(a, s, g, d, v):
            a[s, g, d] = f32_to_f16_bits(v)
        return put16

    def put32(a, s, g, d, v):
        a[s, g, d] = v
    return put32


@overload(kv_half, inline="always")
def _kv_half(a):
    half = a.dtype == types.uint16
    return lambda a: half


@nb.njit(inline="always")
def kv_round(a, v):
    """v as the products with this cache's values see it: rounded to float16 for a float16 cache (ggml converts
    Q and the probabilities to the cache's type), else unchanged."""
    return _f16(v) if kv_half(a) else v


@nb.njit(inline="always")
def _fold(acc, lanes):
    """ggml_vec_dot_f32's reduction of its 4 accumulators of `lanes` (acc: [4 lanes], accumulator j at lanes j..):
    (0+2)+(1+3), then AVX2's two hadds, or AVX-512's _mm512_reduce_add_ps (halves added, then hsum8)."""
    t = np.empty(16, F32)
    for lane in range(lanes):
        t[lane] = (acc[lane] + acc[2 * lanes + lane]) + (acc[lanes + lane] + acc[3 * lanes + lane])
    if lanes == 16:
        for lane in range(8):
            t[lane] = t[lane] + t[lane + 8]
        return _fold8(t, 0)
    return ((t[0] + t[4]) + (t[1] + t[5])) + ((t[2] + t[6]) + (t[3] + t[7]))


@nb.njit(inline="always")
def _fold8(e, at):
    """hsum8 of e[at:at+8]: ((e0+e4)+(e2+e6)) + ((e1+e5)+(e3+e7))."""
    return ((e[at] + e[at + 4]) + (e[at + 2] + e[at + 6])) + ((e[at + 1] + e[at + 5]) + (e[at + 3] + e[at + 7]))


@nb.njit(inline="always")
def _hsum(e, at, lanes):
    """ggml_cpu.hsum of e[at:at + lanes]: 16 lanes add their halves first."""
    if lanes == 16:
        t = np.empty(8, F32)
        for lane in range(8):
            t[lane] = e[at + lane] + e[at + 8 + lane]
        return _fold8(t, 0)
    return _fold8(e, at)


@nb.njit(inline="always")
def _vec_dot(q, k, s, g, acc, f64_leftovers, lanes):
    """ggml_vec_dot_f32 (or _f16) of q and k[s, g]: 4 lanes accumulators over Hd (acc: [4 lanes] scratch),
    folded; the leftovers in order, in float64 for float16 as ggml_cpu's emulation has it."""
    hd, step = q.shape[0], 4 * lanes
    body = hd - hd % step
    acc[:] = 0
    for i in range(0, body, step):
        for lane in range(step):
            acc[lane] = _fma(q[i + lane], kv_get(k, s, g, i + lane), acc[lane])
    r = _fold(acc, lanes)
    if f64_leftovers:
        r64 = np.float64(r)
        for i in range(body, hd):
            r64 = r64 + np.float64(q[i] * kv_get(k, s, g, i))
        return np.float32(r64)
    for i in range(body, hd):
        r = r + q[i] * kv_get(k, s, g, i)
    return r


@nb.njit(inline="always")
def _scores(q, k, n, g, scale, z, lanes):
    """z[s] = vec_dot(q, k[s, g]) * scale for s < n (ggml_vec_dot_f32, or _f16 on a float16 cache with q rounded to
    float16)."""
    acc = np.empty(4 * lanes, F32)
    for s in range(n):
        z[s] = _vec_dot(q, k, s, g, acc, kv_half(k), lanes) * scale + F32(0)   # + the mask's 0, as the emulation


@nb.njit(inline="always")
def _softmax(z, n8, lanes):
    """z: [S] scores (no mask: one new token sees every position) -> probabilities [S] (ggml_cpu.softmax: v_expf
    in chunks of `lanes` from position 0, each chunk's hsum added to a float64 total, times (float)(1/total))."""
    n = z.shape[0]
    top = z[0]
    for s in range(1, n):
        top = max(top, z[s])
    e = np.zeros(n8, F32)
    for s in range(n):                 # a masked score's exp is 0 (v_expf(-inf) = 0) where the top is finite
        e[s] = F32(0) if z[s] == -np.inf and top != -np.inf else v_expf(z[s] - top, lanes)
    total = 0.0
    for c in range(0, n8, lanes):
        total += np.float64(_hsum(e, c, lanes))
    inv = np.float32(1.0 / total)
    for s in range(n):
        z[s] = e[s] * inv


@nb.njit(parallel=True, cache=True)
def attend(q, k, v, n, scale, kv_head, lanes):
    """One query token (ggml_cpu.make_attention(kv_dtype), one row) over the first n positions of the cache: q:
    [H, Hd], k, v: [n_ctx, KV, Hd] float32 or float16 bits (uint16) -> [H * Hd]. Q.K and P.V by ggml's vec_dot
    (P and V padded with zeros to 4 lanes positions); on a float16 cache Q and P rounded to float16 first."""
    nh, hd = q.shape
    step = 4 * lanes
    n32 = -(-n // step) * step
    out = np.empty((nh, hd), F32)
    for h in nb.prange(nh):
        g = kv_head[h]
        qh = np.empty(hd, F32)
        for d in range(hd):
            qh[d] = kv_round(k, q[h, d])
        z = np.empty(n, F32)
        _scores(qh, k, n, g, F32(scale), z, lanes)
        _softmax(z, -(-n // lanes) * lanes, lanes)
        acc = np.zeros((step, hd), F32)
        for c in range(0, n32, step):
            for lane in range(step):
                s = c + lane
                p = kv_round(v, z[s]) if s < n else F32(0)
                for d in range(hd):
                    acc[lane, d] = _fma(p, kv_get(v, s, g, d) if s < n else F32(0), acc[lane, d])
        for d in range(hd):
            out[h, d] = _fold(acc[:, d], lanes)
    return out.reshape(nh * hd)


@nb.njit(parallel=True, cache=True)
def rms_norm_rows(x, w, eps):
    """x: [T, D] -> [T, D]: rms_norm of each row, a row a thread (ggml_cpu.rms_norm's bits: K.rms_norm_rows)."""
    out = np.empty_like(x)
    for t in nb.prange(x.shape[0]):
        K.rms_norm_rows(x[t:t + 1], w, eps, out[t:t + 1])
    return out


@nb.njit(cache=True)
def rms_norm(x, w, eps):
    """x: [D] -> x * (1/sqrtf(mean(x^2) + eps)) * w, the squares summed in float64 in order (ggml's rms_norm)."""
    out = np.empty((1, x.shape[0]), F32)
    K.rms_norm_rows(x.reshape(1, -1), w, eps, out)
    return out[0]


@nb.njit(cache=True)
def swiglu_hidden(gu, nf, lanes):
    """gu: [2F] (gate, then up) -> silu(gate) * up, silu = x / (1 + v_expf(-x)) in float32 (ggml_cpu.silu)."""
    out = np.empty(nf, F32)
    for j in range(nf):
        x = gu[j]
        out[j] = (x / (F32(1) + v_expf(F32(0) - x, lanes))) * gu[nf + j]
    return out


@nb.njit(parallel=True, cache=True)
def silu_mul_rows(g, u, lanes):
    """g, u: [T, F] -> silu(g) * u (swiglu_hidden for several tokens; ggml_cpu.make_ops's swiglu), a token a thread."""
    out = np.empty_like(g)
    for t in nb.prange(g.shape[0]):
        for j in range(g.shape[1]):
            x = g[t, j]
            out[t, j] = (x / (F32(1) + v_expf(F32(0) - x, lanes))) * u[t, j]
    return out


@nb.njit(cache=True)
def members_product(codes, n_blocks, rows, bounds, j0, j1, x):
    """x [K] times members j0..j1-1 of a layer's matrices (member j: type code codes[j], n_blocks[j] blocks a row,
    its rows' addresses rows[bounds[j]:bounds[j + 1]]) -> [N]: consecutive members of one type by one product call,
    each row as its own matrix's product computes it."""
    out = np.empty(bounds[j1] - bounds[j0], F32)
    j = j0
    while j < j1:                                      # one call site: product compiled into this code once
        e = K.run_end(codes, j, j1)
        part = product(codes[j], rows[bounds[j]:bounds[e]], n_blocks[j], x)
        if j == j0 and e == j1:
            return part                                # one type: nothing to copy
        out[bounds[j] - bounds[j0]:bounds[e] - bounds[j0]] = part
        j = e
    return out


@nb.njit(cache=True)
def decode_layer(x, attn_norm, ffn_norm, eps, codes, n_blocks, rows, bounds, edges, nq, nk, nf, cos, sin, neox, kc,
                 vc, pos, scale, kv_head, lanes):
    """One token through one llama layer as ops.block runs it with ggml's kernels: x [D] f32 -> [D]; writes K and V
    at `pos` of kc, vc [n_ctx, KV, Hd] (float32, or float16 as uint16 bits). codes, n_blocks: [7], the type code and
    blocks a row of Q, K, V, output, gate, up, down; rows: their rows' addresses, in that order (nq, nk, nk, D, nf,
    nf, D rows; bounds: numba_kernels.member_bounds, where each starts; edges: numba_kernels.group_edges)."""
    n_kv, hd = kc.shape[1], kc.shape[2]
    y = members_product(codes, n_blocks, rows, bounds, edges[0], edges[1], rms_norm(x, attn_norm, eps))
    qr = rope(y[:nq].reshape(nq // hd, hd), cos, sin, neox)
    kr = rope(y[nq:nq + nk].reshape(n_kv, hd), cos, sin, neox)
    for g in range(n_kv):
        for d in range(hd):
            kv_put(kc, pos, g, d, kr[g, d])
            kv_put(vc, pos, g, d, y[nq + nk + g * hd + d])
    att = attend(qr, kc, vc, pos + 1, scale, kv_head, lanes)
    x = x + members_product(codes, n_blocks, rows, bounds, edges[1], edges[2], att)
    gu = members_product(codes, n_blocks, rows, bounds, edges[2], edges[3], rms_norm(x, ffn_norm, eps))
    return x + members_product(codes, n_blocks, rows, bounds, edges[3], edges[4], swiglu_hidden(gu, nf, lanes))


@nb.njit(cache=True)
def decode_step(x, attn_norms, ffn_norms, eps, codes, n_blocks, rows, nq, nk, nf, cos, sin, neox, kc, vc, pos, scale,
                kv_head, lanes):
    """Every layer of a one-token step (decode_layer for layer i: attn_norms, ffn_norms [L, D], codes, n_blocks
    [L, 7], rows [L, N], K/V at `pos` of kc, vc [L, n_ctx, KV, Hd]): x [D] -> [D]."""
    bounds, groups = K.member_bounds(nq, nk, x.shape[0], nf), K.group_edges()
    for i in range(attn_norms.shape[0]):
        x = decode_layer(x, attn_norms[i], ffn_norms[i], eps, codes[i], n_blocks[i], rows[i], bounds, groups, nq, nk,
                         nf, cos, sin, neox, kc[i], vc[i], pos, scale, kv_head, lanes)
    return x


@nb.njit(cache=True)
def decode_step8(x, attn_norms, ffn_norms, eps, codes, n_blocks, rows, nq, nk, nf, cos, sin, neox, kc, vc, pos, scale,
                 kv_head):
    """decode_step for an AVX2 build: lanes a constant where numba compiles (10% faster than a variable)."""
    return decode_step(x, attn_norms, ffn_norms, eps, codes, n_blocks, rows, nq, nk, nf, cos, sin, neox, kc, vc, pos,
                       scale, kv_head, 8)


@nb.njit(cache=True)
def decode_step16(x, attn_norms, ffn_norms, eps, codes, n_blocks, rows, nq, nk, nf, cos, sin, neox, kc, vc, pos,
                  scale, kv_head):
    """decode_step for an AVX-512 build."""
    return decode_step(x, attn_norms, ffn_norms, eps, codes, n_blocks, rows, nq, nk, nf, cos, sin, neox, kc, vc, pos,
                       scale, kv_head, 16)


@nb.njit(inline="always")
def _lanes_dot(a, b, n, lanes):
    """numba_simd.lanes_dot at the build's width (a constant there): one `lanes` accumulator, hsum."""
    if lanes == 16:
        return S.lanes_dot(a, b, n, 16)
    return S.lanes_dot(a, b, n, 8)


@nb.njit(inline="always")
def _dot_f32(a, b, n, lanes):
    """numba_simd.vec_dot_f32 at the build's width: ggml_vec_dot_f32 (_vec_dot's arithmetic on float32s)."""
    if lanes == 16:
        return S.vec_dot_f32(a, b, n, 16)
    return S.vec_dot_f32(a, b, n, 8)


@nb.njit(parallel=True, cache=True)
def float_rows(x, w, tiny, lanes, out):
    """x: [T, K] f32, w: [N, K] f32 (F16 weights and activations as float32 values) -> out [T, N]: ggml_cpu's
    FloatMatrix.matmul on float32 values: tinyBLAS's `lanes` FMA lanes over K, then hsum, where tiny; else
    ggml_vec_dot_f32 (leftovers in float32). One output row a thread: the bits do not depend on the count."""
    t_n, k = x.shape
    xa, wa = x.ctypes.data, w.ctypes.data
    for j in nb.prange(w.shape[0]):
        for t in range(t_n):
            a, b = xa + 4 * t * k, wa + 4 * j * k
            out[t, j] = _lanes_dot(a, b, k, lanes) if tiny else _dot_f32(a, b, k, lanes)


@nb.njit(inline="always")
def _seen_until(mask, t, skip):
    """The positions row t of a prefill's attention computes: all (mask's width), or with `skip` up to its last
    unmasked one (the rest add fma(0, v, acc) = acc)."""
    if not skip:
        return mask.shape[1]
    for s in range(mask.shape[1] - 1, -1, -1):
        if mask[t, s] != -np.inf:
            return s + 1
    return mask.shape[1]                              # every position masked: computed as they are


@nb.njit(parallel=True, cache=True)
def attend_rows(q, k, v, mask, scale, kv_head, half, lanes, skip):
    """Several new tokens (ggml_cpu.make_attention(kv_dtype) for T > 1, llama.cpp's tinyBLAS products): q: [T, H, Hd]
    f32 (Hd % lanes == 0), k, v: [S, KV, Hd] f32 (the cache's values), mask: [T, S] f32, half: a float16 cache ->
    (out [T, H*Hd], kq, probs [H, T, S]). Q.K by ggml_vec_dot_f32 on a float32 cache, by `lanes` FMA lanes with Q
    rounded to float16 on a float16 one; the softmax of kq * scale + mask; P.V by `lanes` FMA lanes over the
    positions padded to a multiple of lanes (P rounded to float16 on a float16 cache). One (head, token) pair a
    thread. skip (attention_out: nobody sees kq or probs): positions whose mask is -inf are left out, their score
    -inf as it would be, and P.V stops at the lanes chunk of the last position seen; the same bits wherever Q and K
    are finite and small enough that no score overflows and V is finite (the caller checks: otherwise ggml's NaNs
    must come out), and kq, probs then hold nothing at the positions left out."""
    t_n, nh, hd = q.shape
    s_n = k.shape[0]
    s8 = -(-s_n // lanes) * lanes
    kq = np.empty((nh, t_n, s_n), F32)
    probs = np.empty((nh, t_n, s_n), F32)
    out = np.empty((t_n, nh, hd), F32)
    vt = np.zeros((v.shape[1], hd, s8), F32)         # V by KV head as [Hd, S], zero-padded: P.V reads it in order
    for s in range(s_n):
        for g in range(v.shape[1]):
            for d in range(hd):
                vt[g, d, s] = v[s, g, d]
    for ht in nb.prange(nh * t_n):
        h, t = ht // t_n, ht % t_n
        g = kv_head[h]
        qh = np.empty(hd, F32)
        for d in range(hd):
            qh[d] = _f16(q[t, h, d]) if half else q[t, h, d]
        seen = _seen_until(mask, t, skip)
        qa, ka = qh.ctypes.data, k.ctypes.data
        for s in range(s_n):
            if skip and (s >= seen or mask[t, s] == -np.inf):
                continue
            row = ka + 4 * (s * k.shape[1] + g) * hd
            # tinyBLAS f16: `lanes` lanes over Hd, hsum; f32: ggml_vec_dot_f32
            kq[h, t, s] = _lanes_dot(qa, row, hd, lanes) if half else _dot_f32(qa, row, hd, lanes)
        z = np.empty(s_n, F32)
        for s in range(s_n):
            z[s] = -np.inf if skip and (s >= seen or mask[t, s] == -np.inf) else kq[h, t, s] * scale + mask[t, s]
        _softmax(z, s8, lanes)
        zp = np.zeros(s8, F32)                       # the padding's products: fma(0, 0, acc), as ggml's tile has them
        for s in range(s_n):
            probs[h, t, s] = z[s]
            zp[s] = _f16(z[s]) if half else z[s]
        chunks = -(-seen // lanes) * lanes
        for d in range(hd):
            out[t, h, d] = _lanes_dot(zp.ctypes.data, vt.ctypes.data + 4 * (g * hd + d) * s8, chunks, lanes)
    return out.reshape(t_n, nh * hd), kq, probs


@nb.njit(cache=True)
def attend_rows8(q, k, v, mask, scale, kv_head, half, skip):
    """attend_rows for an AVX2 build, lanes a constant where numba compiles (a variable made prompts 18% slower)."""
    return attend_rows(q, k, v, mask, scale, kv_head, half, 8, skip)


@nb.njit(cache=True)
def attend_rows16(q, k, v, mask, scale, kv_head, half, skip):
    """attend_rows for an AVX-512 build."""
    return attend_rows(q, k, v, mask, scale, kv_head, half, 16, skip)


def can_skip_masked(q, k, v, half) -> bool:
    """Whether attend_rows may leave masked positions out without changing a bit: every |Q| and |K| below 1e18
    (no score overflows: 256 products of 1e36 stay under float32's 3.4e38; on a float16 cache Q below 65504, where
    its rounding to float16 stays finite) and V finite (0 * V adds nothing). NaNs fail the comparisons."""
    bound = 65504.0 if half else 1e18
    return bool(q.shape[2] <= 256 and np.abs(q).max() < bound and np.abs(k).max() < bound and np.isfinite(v).all())


# -- a C function of the process over an array: ggml's RoPE tables (ggml_cpu.rope_angles' map_c) -----------
@intrinsic
def _call_c_float(typingctx, address, x):
    """The C function float f(float) at `address` (an integer: a run-time value, so that the cached machine code
    holds no address of this process) called on x."""
    def codegen(context, builder, signature, args):
        fnty = ir.FunctionType(ir.FloatType(), [ir.FloatType()])
        return builder.call(builder.inttoptr(args[0], fnty.as_pointer()), [args[1]])
    return types.float32(types.int64, types.float32), codegen


@nb.njit(cache=True)
def _map_c_float(address, xs, out):
    for i in range(xs.shape[0]):
        out[i] = _call_c_float(address, xs[i])


def map_c_float(fn, xs):
    """fn (a ctypes function float -> float, e.g. the C library's cosf) applied to float32 xs -> float32 [n]: the
    same calls as one ctypes call a value, in a loop of machine code (ggml's 8192-position RoPE tables: 251,094
    distinct angles, two calls each)."""
    import ctypes

    xs = np.ascontiguousarray(xs, dtype=np.float32)
    out = np.empty_like(xs)
    _map_c_float(ctypes.cast(fn, ctypes.c_void_p).value, xs, out)
    return out
