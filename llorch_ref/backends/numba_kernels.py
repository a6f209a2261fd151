"""Numba kernels: matrix-vector products straight from GGUF blocks (decode reads the quantized bytes).

Each output row's sum is computed in a fixed order by one thread (prange over chunks of rows), so results
do not depend on the thread count; fastmath is off; every kernel is compiled once and cached on disk
(cache=True). Within a block the 32 (or 16) products are summed in float32, in element order; the block
sums are accumulated over blocks in float64.

Layout: rows are split into C chunks of R rows (one chunk a thread; R a multiple of 16, the last rows
padding), and each chunk's codes are stored block-major and row-minor, qs[c, b, j, r], so that a thread
streams one contiguous region. The innermost loop runs over the rows r of a chunk, with one float32
partial sum per row kept in a small scratch array: a contiguous, independent loop the compiler turns
into 16-wide vector code with fastmath off (the sums are not reordered, only computed for 16 rows at
once). Three kernels serve every supported type:

  matvec_nibbles  Q4_0, Q4_1: two 4-bit codes per byte (element j low nibble, element j+16 high nibble)
                  per block of 32, w = d * (code - offset) + m
  matvec_q4_k     Q4_K, its nibbles repacked the same way per group of 32, w = d*sc * code - dmin*mn with
                  the 6-bit sc, mn and the super-block's d, dmin read as the file has them
  matvec_bytes    Q8_0 (int8 codes, w = d * code), Q6_K unpacked to one uint8 code per element in groups
                  of 16: w = a * code + c
"""
from __future__ import annotations

from . import numba_wide_vectors

numba_wide_vectors()            # before numba reads its configuration: 512-bit vectors on AVX-512 CPUs

import numba as nb  # noqa: E402
import numpy as np  # noqa: E402


@nb.njit(cache=True)
def _block_sums(x, gs):
    """x: [T, G*gs] f32 -> [T, G] f32 sums of each group, in order (float32, as the kernels' m * sum(x) terms)."""
    n = x.shape[1] // gs
    out = np.empty((x.shape[0], n), dtype=np.float32)
    for t in range(x.shape[0]):
        for g in range(n):
            v = np.float32(0.0)
            for j in range(gs):
                v += x[t, g * gs + j]
            out[t, g] = v
    return out


@nb.njit(inline="always")
def _nibble_block(qb, x, t, b, s, off):
    """s[i] = sum_j (lo_j - off) x_j + (hi_j - off) x_{j+16} over the 16 bytes of block b, row t of x."""
    s[:] = 0.0
    o = np.float32(off)          # subtracted in float32: exact for these small integers, and 16 lanes wide
    for j in range(16):
        xl, xh, qj = x[t, b * 32 + j], x[t, b * 32 + j + 16], qb[j]
        for i in range(s.shape[0]):
            q = qj[i]
            s[i] += ((np.float32(np.int32(q & np.uint8(15))) - o) * xl
                     + (np.float32(np.int32(q >> np.uint8(4))) - o) * xh)


@nb.njit(inline="always")
def _nibbles_chunk(qs, d16, m16, f16, x, xsum, acc, s, dc, mc, c, off):
    """Chunk c of matvec_nibbles for every row t of x; off is a constant at each call site (0: Q4_1, with
    m; 8: Q4_0, without)."""
    w = qs.shape[3]
    for b in range(qs.shape[1]):
        qb, db = qs[c, b], d16[c, b]
        for i in range(w):
            dc[i] = f16[db[i]]
        if off == 0:
            mb = m16[c, b]
            for i in range(w):
                mc[i] = f16[mb[i]]
        for t in range(x.shape[0]):
            _nibble_block(qb, x, t, b, s, off)
            if off == 0:
                xs = xsum[t, b]
                for i in range(w):
                    acc[t, i] += dc[i] * s[i] + mc[i] * xs
            else:
                for i in range(w):
                    acc[t, i] += dc[i] * s[i]


@nb.njit(parallel=True, cache=True, fastmath=False)
def matvec_nibbles(qs, d16, m16, offset, f16, x, out):
    """qs: [C, B, 16, R] uint8 (the file's 16 bytes of each block: element j low nibble, j+16 high), d16, m16:
    [C, B, R] uint16 (the file's float16 scale and min; Q4_0: m16 empty), offset: 8 (Q4_0) or 0 (Q4_1),
    f16: [65536] f32 (float16 bits -> value), x: [T, B*32] f32 -> out: [T, C*R] f32 (T = 1 for a decode
    step; each row t exactly as alone: the block is read once).

    out[n] = sum_b d[b,n] * s_b (+ m[b,n] * sum(x_b)), s_b = sum_j (lo_j - offset) x_j + (hi_j - offset) x_{j+16}."""
    n_chunks, w = qs.shape[0], qs.shape[3]
    xsum = _block_sums(x, 32)
    for c in nb.prange(n_chunks):
        acc = np.zeros((x.shape[0], w), dtype=np.float64)
        s, dc, mc = np.empty(w, dtype=np.float32), np.empty(w, dtype=np.float32), np.empty(w, dtype=np.float32)
        if offset == 0:
            _nibbles_chunk(qs, d16, m16, f16, x, xsum, acc, s, dc, mc, c, 0)
        else:
            _nibbles_chunk(qs, d16, m16, f16, x, xsum, acc, s, dc, mc, c, 8)
        for t in range(x.shape[0]):
            for i in range(w):
                out[t, c * w + i] = acc[t, i]


@nb.njit(parallel=True, cache=True, fastmath=False)
def matvec_q4_k(qs, sc, mn, d16, dmin16, f16, x, out):
    """Q4_K from its own scales: qs [C, G, 16, R] uint8 (groups of 32 as matvec_nibbles reads them), sc, mn:
    [C, G, R] uint8 (6-bit scale and min of each group), d16, dmin16: [C, G/8, R] uint16 (the super-block's
    float16 d and dmin as the file has them), x: [T, G*32] f32 -> out: [T, C*R] f32.

    Group g: w = d*sc * q - dmin*mn, so out[n] = sum_g (d*sc) s_g - (dmin*mn) sum(x_g): the same float32
    values as matvec_nibbles with d = d*sc and m = -dmin*mn (both products exact in float32), from 18
    bytes per 32 weights, the file's own size."""
    n_chunks, n_groups, _, w = qs.shape
    xsum = _block_sums(x, 32)
    for c in nb.prange(n_chunks):
        acc = np.zeros((x.shape[0], w), dtype=np.float64)
        s, dc, mc = np.empty(w, dtype=np.float32), np.empty(w, dtype=np.float32), np.empty(w, dtype=np.float32)
        for g in range(n_groups):
            qb, scg, mng = qs[c, g], sc[c, g], mn[c, g]
            if g % 8 == 0:
                db, dmb = d16[c, g // 8], dmin16[c, g // 8]
                for i in range(w):
                    dc[i] = f16[db[i]]
                    mc[i] = f16[dmb[i]]
            for t in range(x.shape[0]):
                _nibble_block(qb, x, t, g, s, 0)
                xs = xsum[t, g]
                for i in range(w):
                    acc[t, i] += (dc[i] * np.float32(scg[i])) * s[i] + (-(mc[i] * np.float32(mng[i]))) * xs
        for t in range(x.shape[0]):
            for i in range(w):
                out[t, c * w + i] = acc[t, i]


# -- laying the file's blocks out for the kernels: one pass, parallel over rows, nothing unpacked ----------
@nb.njit(inline="always")
def _u16(row, o):
    """The little-endian 16-bit word at byte o of row (a float16 scale's bits)."""
    return np.uint16(row[o]) | (np.uint16(row[o + 1]) << np.uint16(8))


@nb.njit(parallel=True, cache=True)
def lay_out_nibbles(blocks, type_size, q_at, row0, qs, d16, m16):
    """Q4_0 (type_size 18, q_at 2) and Q4_1 (20, 4; m16 non-empty) rows of the file's blocks [n, B*type_size]
    -> rows row0.. of the tiled layout (qs [C, B, 16, R], d16, m16 [C, B, R]): the same bytes, rows minor.
    In tiles of 16 destination rows (R % 16 == 0: a tile never straddles two chunks): each tile's rows are
    read in order, and each code byte is written for 16 rows at a time."""
    r_len, n = qs.shape[3], blocks.shape[0]
    first, last = row0 // 16, (row0 + n - 1) // 16
    for tile in nb.prange(first, last + 1):
        g0 = tile * 16
        lo, hi = max(row0, g0), min(row0 + n, g0 + 16)          # destination rows of this tile
        c, i0 = g0 // r_len, g0 % r_len
        for b in range(qs.shape[1]):
            o = b * type_size
            for g in range(lo, hi):
                r, i = g - row0, i0 + g - g0
                d16[c, b, i] = _u16(blocks[r], o)
                if m16.shape[0] > 0:
                    m16[c, b, i] = _u16(blocks[r], o + 2)
            for j in range(16):
                for g in range(lo, hi):
                    qs[c, b, j, i0 + g - g0] = blocks[g - row0, o + q_at + j]


@nb.njit(parallel=True, cache=True)
def lay_out_q4_k(blocks, row0, qs, sc, mn, d16, dmin16):
    """Q4_K rows [n, NB*144] -> rows row0.. of qs [C, G, 16, R] (group g's 32 nibbles as element j low,
    j+16 high), sc, mn [C, G, R] (get_scale_min_k4), d16, dmin16 [C, NB, R]."""
    r_len = qs.shape[3]
    for r in nb.prange(blocks.shape[0]):
        c, i = (row0 + r) // r_len, (row0 + r) % r_len
        row = blocks[r]
        for sb in range(d16.shape[1]):
            o = sb * 144
            d16[c, sb, i] = _u16(row, o)
            dmin16[c, sb, i] = _u16(row, o + 2)
            for k in range(8):
                if k < 4:
                    scale, mins = row[o + 4 + k] & 63, row[o + 8 + k] & 63
                else:
                    scale = (row[o + 8 + k] & 15) | ((row[o + k] >> 6) << 4)
                    mins = (row[o + 8 + k] >> 4) | ((row[o + 4 + k] >> 6) << 4)
                g = sb * 8 + k
                sc[c, g, i] = scale
                mn[c, g, i] = mins
                base, shift = o + 16 + 32 * (k // 2), 4 * (k % 2)
                for j in range(16):
                    lo = (row[base + j] >> shift) & 15
                    hi = (row[base + j + 16] >> shift) & 15
                    qs[c, g, j, i] = lo | (hi << 4)


@nb.njit(parallel=True, cache=True)
def lay_out_q8_0(blocks, f16, row0, qs, a):
    """Q8_0 rows [n, B*34] -> rows row0.. of qs [C, B, 32, R] int8 and a [C, B, R] f32 (the float16 d)."""
    r_len = qs.shape[3]
    for r in nb.prange(blocks.shape[0]):
        c, i = (row0 + r) // r_len, (row0 + r) % r_len
        row = blocks[r]
        for b in range(qs.shape[1]):
            o = b * 34
            a[c, b, i] = f16[np.int64(row[o]) | (np.int64(row[o + 1]) << 8)]
            for j in range(32):
                qs[c, b, j, i] = np.int8(row[o + 2 + j]) if row[o + 2 + j] < 128 else np.int8(np.int32(row[o + 2 + j]) - 256)


@nb.njit(inline="always")
def _bytes_chunk(qs, a, c, x, xsum, acc, s, ci, gs, affine):
    """Chunk ci of matvec_bytes for every row t of x; gs and affine are constants at each call site."""
    w = qs.shape[3]
    for g in range(qs.shape[1]):
        qg, ag = qs[ci, g], a[ci, g]
        for t in range(x.shape[0]):
            s[:] = 0.0
            for j in range(gs):
                xj, qj = x[t, g * gs + j], qg[j]
                for i in range(w):
                    s[i] += np.float32(np.int32(qj[i])) * xj       # via int32: 16 lanes wide
            if affine:
                cg, xs = c[ci, g], xsum[t, g]
                for i in range(w):
                    acc[t, i] += ag[i] * s[i] + cg[i] * xs
            else:
                for i in range(w):
                    acc[t, i] += ag[i] * s[i]


@nb.njit(parallel=True, cache=True, fastmath=False)
def matvec_bytes(qs, a, c, x, out):
    """qs: [C, G, S, R] uint8 or int8 codes, a, c: [C, G, R] f32 (c: [0, 0, 0] for none), x: [T, G*S] f32
    -> out[t, n] = sum_g a*sum_j q*x + c*sum_j x (T = 1 for a decode step; each row t exactly as alone).

    Q8_0: int8 codes, S = 32, a = d, no c. Q6_K after unpacking: w = a * q + c per group of S = 16 elements,
    a = d*scale, c = -32*d*scale."""
    n_chunks, _, gs, w = qs.shape
    xsum = _block_sums(x, gs)
    affine = c.shape[0] > 0
    for ci in nb.prange(n_chunks):
        acc = np.zeros((x.shape[0], w), dtype=np.float64)
        s = np.empty(w, dtype=np.float32)
        if not affine and gs == 32:
            _bytes_chunk(qs, a, c, x, xsum, acc, s, ci, 32, False)
        elif not affine:
            _bytes_chunk(qs, a, c, x, xsum, acc, s, ci, gs, False)
        elif gs == 32:
            _bytes_chunk(qs, a, c, x, xsum, acc, s, ci, 32, True)
        elif gs == 16:
            _bytes_chunk(qs, a, c, x, xsum, acc, s, ci, 16, True)
        else:
            _bytes_chunk(qs, a, c, x, xsum, acc, s, ci, gs, True)
        for t in range(x.shape[0]):
            for i in range(w):
                out[t, ci * w + i] = acc[t, i]


# The elementwise kernels below serve one token (a few thousand floats): serial, since starting the
# parallel workers costs more than the work.

@nb.njit(cache=True, fastmath=False)
def rms_norm_rows(x, w, eps, out):
    """x: [T, D] f32, w: [D] -> out: [T, D]; sum of squares in float64 (as the NumPy reference)."""
    t, dim = x.shape
    for i in range(t):
        ss = 0.0
        for j in range(dim):
            v = x[i, j] * x[i, j]
            ss += v
        scale = np.float32(1.0) / np.sqrt(np.float32(ss / dim) + np.float32(eps))
        for j in range(dim):
            out[i, j] = (x[i, j] * scale) * w[j]


@nb.njit(cache=True, fastmath=False)
def silu_mul(g, u, out):
    """out = g / (1 + exp(-g)) * u, elementwise over [F] f32."""
    for j in range(g.shape[0]):
        v = g[j]
        out[j] = v / (np.float32(1.0) + np.exp(-v)) * u[j]


@nb.njit(cache=True, fastmath=False)
def rope_one(x, cos, sin, neox, out):
    """x: [nh, Hd] f32 (one token), cos, sin: [R/2] -> out: [nh, Hd]; pairs (2i, 2i+1) or, with neox,
    (i, i + R/2), rotated as the reference: y0 = x0 c - x1 s, y1 = x0 s + x1 c; dims past R copied."""
    nh, hd = x.shape
    half = cos.shape[0]
    for h in range(nh):
        for d in range(2 * half, hd):
            out[h, d] = x[h, d]
        for i in range(half):
            i0, i1 = (i, i + half) if neox else (2 * i, 2 * i + 1)
            x0, x1 = x[h, i0], x[h, i1]
            out[h, i0] = x0 * cos[i] - x1 * sin[i]
            out[h, i1] = x0 * sin[i] + x1 * cos[i]


@nb.njit(inline="always")
def _attend_head(h, q, k, v, mask, scale, kv_head, out, kq, probs):
    """attend_one for query head h."""
    hd = q.shape[1]
    n_pos = k.shape[0]
    body = n_pos - n_pos % 8
    g = kv_head[h]
    t = np.empty(8, np.float32)
    for s0 in range(0, body, 8):
        t[:] = 0.0
        for d in range(hd):
            qd = q[h, d]
            for u in range(8):
                t[u] += qd * k[s0 + u, g, d]
        for u in range(8):
            kq[h, s0 + u] = t[u]
    for s in range(body, n_pos):
        x = np.float32(0.0)
        for d in range(hd):
            x += q[h, d] * k[s, g, d]
        kq[h, s] = x
    top = -np.inf
    for s in range(n_pos):
        z = kq[h, s] * np.float32(scale) + mask[s]
        probs[h, s] = z
        top = max(top, z)
    total = 0.0
    for s in range(n_pos):
        e = np.exp(probs[h, s] - np.float32(top))
        probs[h, s] = e
        total += e
    inv = np.float32(1.0 / total)
    for d in range(hd):
        out[h, d] = 0.0
    for s in range(n_pos):
        p = probs[h, s] * inv
        probs[h, s] = p
        for d in range(hd):
            out[h, d] += p * v[s, g, d]


@nb.njit(parallel=True, cache=True, fastmath=False)
def attend_one(q, k, v, mask, scale, kv_head, out, kq, probs):
    """One query token. q: [H, Hd], k, v: [S, KV, Hd], mask: [S] (0 or -inf), kv_head: [H] int ->
    out: [H, Hd], kq: [H, S] raw scores, probs: [H, S] (all f32).

    Per head: kq[s] = q . k[s] (float32, in order over Hd; eight positions at a time, for independent
    chains); probs = softmax(kq * scale + mask) with the exponentials in float32 and their sum in float64
    (as the reference); out = sum_s probs[s] v[s] (float32, in order over s)."""
    for h in nb.prange(q.shape[0]):
        _attend_head(h, q, k, v, mask, scale, kv_head, out, kq, probs)


@nb.njit(cache=True, fastmath=False)
def attend_one_serial(q, k, v, mask, scale, kv_head, out, kq, probs):
    """attend_one without worker threads, for a model whose other products run on BLAS: a numba parallel
    region per layer between BLAS calls makes both thread pools contend for the cores (measured on 2 cores:
    a decode step 270 ms instead of 22)."""
    for h in range(q.shape[0]):
        _attend_head(h, q, k, v, mask, scale, kv_head, out, kq, probs)


# -- numerics="ggml": llama.cpp's quantized dot products (ggml_cpu.QuantMatrix), bit for bit ---------------

@nb.njit(parallel=True, cache=True, fastmath=False)
def ggml_q8_dot(q, d, m, qa, da, sa, out):
    """q: [C, B, 32, R] int8 weight codes, d, m: [C, B, R] f32 (m: [0, 0, 0] for none), qa: [T, B, 32] int8
    activation codes, da, sa: [T, B] f32 -> out: [T, C*R] f32, exactly as numerics.ggml_cpu.QuantMatrix
    computes it: per block, lane l holds the integer sum of elements 4l..4l+3 and acc_l = fma(d*da, lane,
    acc_l) (the FMA emulated in float64, as there); then ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7)), plus
    sum_b m*sa in float32."""
    n_chunks, n_blocks, _, w = q.shape
    has_m = m.shape[0] > 0
    for c in nb.prange(n_chunks):
        acc = np.empty((8, w), np.float32)
        isum = np.empty(w, np.int32)
        dd = np.empty(w, np.float32)
        summs = np.empty(w, np.float32)
        for t in range(qa.shape[0]):
            acc[:] = 0.0
            summs[:] = 0.0
            for b in range(n_blocks):
                qb, db, dab = q[c, b], d[c, b], da[t, b]
                for i in range(w):
                    dd[i] = db[i] * dab
                for l in range(8):
                    isum[:] = 0
                    for k in range(4):
                        qe, xe = qb[4 * l + k], np.int32(qa[t, b, 4 * l + k])
                        for i in range(w):
                            isum[i] += np.int32(qe[i]) * xe
                    for i in range(w):
                        acc[l, i] = np.float32(np.float64(dd[i]) * np.float64(isum[i]) + np.float64(acc[l, i]))
                if has_m:
                    mb, sab = m[c, b], sa[t, b]
                    for i in range(w):
                        summs[i] = summs[i] + mb[i] * sab
            for i in range(w):
                y = (((acc[0, i] + acc[4, i]) + (acc[2, i] + acc[6, i]))
                     + ((acc[1, i] + acc[5, i]) + (acc[3, i] + acc[7, i])))
                out[t, c * w + i] = y + summs[i] if has_m else y


# -- one decode step of a layer in one call (NumbaBackend.make_decoder): the kernels above, in the order and
# with the arguments the op-by-op path gives them, so that the logits are the same to the bit ---------------
@nb.njit(cache=True)
def _mv(g, f16, x, out):
    """g = (kind, qs, s1, s2, s3, s4, offset): kind 0 "nibbles" (s1, s2 = d, m), 1 "q4k" (s1, s2 = d, dmin;
    s3, s4 = sc, mn)."""
    kind, qs, s1, s2, s3, s4, off = g
    if kind == 0:
        matvec_nibbles(qs, s1, s2, off, f16, x, out)
    else:
        matvec_q4_k(qs, s3, s4, s1, s2, f16, x, out)


@nb.njit(cache=True)
def _mv_out(g, f16, x):
    out = np.empty((1, g[1].shape[0] * g[1].shape[3]), np.float32)
    _mv(g, f16, x, out)
    return out


@nb.njit(cache=True)
def decode_layer(x, attn_norm, ffn_norm, eps, g_qkv, g_o, g_gu, g_down, nq, nk, nf, f16, cos, sin, neox,
                 kc, vc, pos, scale, kv_head, parallel_attention):
    """One token through one llama layer: x [1, D] f32 -> [1, D]; writes K and V at `pos` of kc, vc [n_ctx, KV,
    Hd]. Q/K/V and gate/up are stacked groups (nq, nk, nf: their row counts)."""
    d = x.shape[1]
    n_kv, hd = kc.shape[1], kc.shape[2]
    h = np.empty_like(x)
    rms_norm_rows(x, attn_norm, eps, h)
    y = _mv_out(g_qkv, f16, h)
    q = np.ascontiguousarray(y[0, :nq]).reshape(nq // hd, hd)
    k = np.ascontiguousarray(y[0, nq:nq + nk]).reshape(n_kv, hd)
    qr, kr = np.empty_like(q), np.empty_like(k)
    rope_one(q, cos, sin, neox, qr)
    rope_one(k, cos, sin, neox, kr)
    kc[pos] = kr
    vc[pos] = y[0, nq + nk:nq + 2 * nk].reshape(n_kv, hd)
    s = pos + 1
    mask = np.zeros(s, np.float32)
    att = np.empty((nq // hd, hd), np.float32)
    kq, probs = np.empty((nq // hd, s), np.float32), np.empty((nq // hd, s), np.float32)
    if parallel_attention:
        attend_one(qr, kc[:s], vc[:s], mask, scale, kv_head, att, kq, probs)
    else:
        attend_one_serial(qr, kc[:s], vc[:s], mask, scale, kv_head, att, kq, probs)
    o = _mv_out(g_o, f16, att.reshape(1, nq))
    x = x + o[:, :d]
    h = np.empty_like(x)
    rms_norm_rows(x, ffn_norm, eps, h)
    gu = _mv_out(g_gu, f16, h)
    hid = np.empty((1, nf), np.float32)
    silu_mul(np.ascontiguousarray(gu[0, :nf]), np.ascontiguousarray(gu[0, nf:2 * nf]), hid[0])
    dn = _mv_out(g_down, f16, hid)
    return x + dn[:, :d]
