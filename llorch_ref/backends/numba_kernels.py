"""Numba kernels: matrix products straight from the GGUF blocks where they lie, and one-token elementwise and
attention kernels.

matmul_rows serves every quantized type (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K): rows are given by
the addresses of their blocks in the mapped file, and each row's dot products run numba_simd's vector loop
(16 lanes, each block's weights made in float32 exactly as the oracle dequantizes them and multiplied into
lane accumulators with fused multiply-adds, a fixed-order tree sum at the row's end). Each row is computed
by one thread, in one order, so results do not depend on the thread count or on how many tokens a call
carries; fastmath is off; every kernel is compiled once and cached on disk. matmul_rows_for(code) is matmul_rows
made for one type (the numba backend's matrices run it: a model's start loads its types' code alone), and
decode_step_for(code) the fused decode step made for a model whose layer matrices all have one type.
"""
from __future__ import annotations

from functools import partial

from . import numba_wide_vectors

numba_wide_vectors()            # before numba reads its configuration: 512-bit vectors on AVX-512 CPUs

import numba as nb  # noqa: E402
import numpy as np  # noqa: E402
from numba import types  # noqa: E402
from numba.extending import overload  # noqa: E402

from . import numba_cache  # noqa: E402
from . import numba_simd as S  # noqa: E402

numba_cache.install()           # before the kernels below are decorated: their cache sees numba_simd's code too


# -- products straight from the file's blocks (numba_simd's vector loops), rows anywhere in memory ------------
@nb.njit(cache=True, fastmath=False)
def _in_lane_order(code, x):
    """x [T, K] f32, each group of 32 in the order the type's blocks give their weights (numba_simd.LANE_ORDER):
    x itself for the types that keep the file's order, else a reordered copy."""
    if not S.REORDERED[code]:
        return x
    order, out = S.LANE_ORDER[code], np.empty_like(x)
    for t in range(x.shape[0]):
        for g in range(0, x.shape[1], 32):
            for i in range(32):
                out[t, g + i] = x[t, g + order[i]]
    return out


@nb.njit(cache=True, fastmath=False)
def matmul_rows(code, rows, n_blocks, x, out):
    """code: numba_simd.TYPE_CODE of the blocks' type, rows: int64 [N] addresses of N rows of its blocks (the
    mapped file's, where they lie; several matrices stacked by address), x: [T, K] f32 -> out: [T, N] f32."""
    _rows_times(code, rows, n_blocks, _in_lane_order(code, x), out)     # an argument: alive through the call


@nb.njit(parallel=True, cache=True, fastmath=False)
def _rows_times(code, rows, n_blocks, x, out):
    """matmul_rows with x in the blocks' lane order. Tiles of 4 rows for one token, of 2 rows by 4 tokens for a
    few, panels (_panels_times) for PANEL_TOKENS or more; every product the same in any tile (and so whatever T or
    the thread count)."""
    t_n, k = x.shape
    n = rows.shape[0]
    ra, xa, oa = rows.ctypes.data, x.ctypes.data, out.ctypes.data
    full, quads = t_n - t_n % 4, n // 4
    if t_n >= S.PANEL_TOKENS[S.SUPER[code]] and quads > 0:
        _panels_times(code, rows, n_blocks, x, out)
        return
    for q in nb.prange(quads):
        r = 4 * q
        ahead = ra + 8 * (r + 8 if q + 2 < quads else r)       # the rows two tiles on, this thread's next but one
        for t in range(0, full, 4):
            S.dot_tile(code, 2, 4, ra + 8 * r, ahead, xa + 4 * t * k, k, oa + 4 * (t * n + r), n,
                       n_blocks)
            S.dot_tile(code, 2, 4, ra + 8 * (r + 2), ahead + 16, xa + 4 * t * k, k,
                       oa + 4 * (t * n + r + 2), n, n_blocks)
        for t in range(full, t_n):
            S.dot_tile(code, 4, 1, ra + 8 * r, ahead, xa + 4 * t * k, k, oa + 4 * (t * n + r), n,
                       n_blocks)
    for r in range(n - n % 4, n):
        for t in range(t_n):
            S.dot_tile(code, 1, 1, ra + 8 * r, ra + 8 * r, xa + 4 * t * k, k, oa + 4 * (t * n + r),
                       n, n_blocks)


@nb.njit(parallel=True, cache=True, fastmath=False)
def _panels_times(code, rows, n_blocks, x, out):
    """_rows_times for many tokens: each thread decodes a panel of 4 rows' weights once, chunk by chunk, into its own
    float32 buffer w and multiplies every token by it (panel_times: the same fused multiply-adds in the same order
    as dot_tile's, so the same products to the bit; acc holds the accumulators between chunks and K-quants'
    passes), instead of decoding each block again for every few tokens; rows past the last panel by dot_tile."""
    t_n, k = x.shape
    n, p = rows.shape[0], 4                # rows a panel: the literal 4 below
    ra, xa, oa = rows.ctypes.data, x.ctypes.data, out.ctypes.data
    panels, kc, big = n // p, (S.PANEL_CHUNK[1] if k > S.PANEL_CHUNK[0] else k), S.SUPER[code]
    for q in nb.prange(panels):         # w, acc: arguments to the call, alive through it
        r, w = p * q, np.empty((p, kc), np.float32)
        acc = np.empty((t_n * p if k > kc or S.PANEL_PASSES[big] else 1, 64), np.float32)
        S.panel_times(code, 4, ra + 8 * r, ra + 8 * (r + p if q + 1 < panels else r), w, acc, xa, k, t_n,
                      oa + 4 * r, n, n_blocks)
    for r in range(p * panels, n):
        for t in range(t_n):
            S.dot_tile(code, 1, 1, ra + 8 * r, ra + 8 * r, xa + 4 * t * k, k, oa + 4 * (t * n + r), n, n_blocks)


FOR_TYPE = {}          # type code -> matmul_rows_for(code)'s kernel, made on first use
# Types whose several-token products run slower made for their one type: Q4_K's 0.86-0.93x at 8 and 64 tokens on
# Zen 5 (the tile's loop is the same machine code; what differs is around it), every other type within 0.95-1.09x
# (4096 x 4096 products from DRAM, each type's kernel against matmul_rows in one process); these keep matmul_rows
# itself. The fused decode step's one-token tiles are as fast either way (0.99-1.05x).
ALL_TYPE_KERNEL = ("Q4_K",)


def matmul_rows_for(code):
    """matmul_rows for the blocks of one type (code: numba_simd.TYPE_CODE) -> a kernel (rows, n_blocks, x, out)
    that numba compiles, and caches, with the code a constant: its tiles hold that type's loops alone, not the
    switch over every type (numba_simd._tile), the same operations in the same order. What numba loads from its
    cache at a model's start is then its types' code alone (the default model's Q4_1 and Q8_0: 155 kB of machine
    code and bitcode against the all-type kernel's 566 kB). ALL_TYPE_KERNEL's types: matmul_rows with the code."""
    code = int(code)
    if code not in FOR_TYPE:
        FOR_TYPE[code] = (partial(matmul_rows, code) if S.NAMES[code] in ALL_TYPE_KERNEL else _one_type(code))
    return FOR_TYPE[code]


def _one_type(code):
    @nb.njit(cache=True, fastmath=False)
    def matmul_rows_of_one_type(rows, n_blocks, x, out):
        _rows_times(code, rows, n_blocks, _in_lane_order(code, x), out)
    return matmul_rows_of_one_type


@nb.njit(parallel=True, cache=True, fastmath=False)
def ggml_rows(code, rows, n_blocks, qa, da, sa, out):
    """numerics "ggml": code: numba_simd.TYPE_CODE of a legacy type (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0), rows: int64 [N]
    addresses of the rows' blocks where they lie, qa: [T, B*32] int8, da, sa: [T, B] f32 (the Q8 activations;
    sa read for Q4_1, Q5_1) -> out: [T, N] f32, bit for bit numerics.ggml_cpu.LegacyQuantMatrix's product."""
    t_n, n = qa.shape[0], rows.shape[0]
    b = da.shape[1]
    ra, qa_a, da_a, sa_a, oa = rows.ctypes.data, qa.ctypes.data, da.ctypes.data, sa.ctypes.data, out.ctypes.data
    quads = n // 4
    full = t_n - t_n % 4
    for q in nb.prange(quads):
        r = 4 * q
        ahead = ra + 8 * (r + 8 if q + 2 < quads else r)
        for t in range(0, full, 4):          # 2 rows x 4 tokens: each block's codes decoded once for 4 tokens
            S.ggml_tile(code, 2, 4, ra + 8 * r, ahead, qa_a + 32 * b * t, 32 * b, da_a + 4 * b * t, sa_a + 4 * b * t, b,
                        oa + 4 * (t * n + r), n, n_blocks)
            S.ggml_tile(code, 2, 4, ra + 8 * (r + 2), ahead + 16, qa_a + 32 * b * t, 32 * b, da_a + 4 * b * t,
                        sa_a + 4 * b * t, b, oa + 4 * (t * n + r + 2), n, n_blocks)
        for t in range(full, t_n):
            S.ggml_tile(code, 4, 1, ra + 8 * r, ahead, qa_a + 32 * b * t, 32 * b, da_a + 4 * b * t, sa_a + 4 * b * t, b,
                        oa + 4 * (t * n + r), n, n_blocks)
    for r in range(4 * quads, n):
        for t in range(t_n):
            S.ggml_tile(code, 1, 1, ra + 8 * r, ra + 8 * r, qa_a + 32 * b * t, 32 * b, da_a + 4 * b * t,
                        sa_a + 4 * b * t, b, oa + 4 * (t * n + r), n, n_blocks)

# The elementwise kernels below serve one token (a few thousand floats), and RMSNorm and RoPE a prompt's rows too:
# serial, since starting the parallel workers costs more than the work.

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


@nb.njit(cache=True, fastmath=False)
def rope_rows(x, cos, sin, neox, out):
    """rope_one for several tokens: x: [T, nh, Hd] f32, cos, sin: [T, R/2] -> out: [T, nh, Hd]; the reference's
    products and sums, each rounded as NumPy rounds them: its RoPE to the bit, without its strided copies."""
    for t in range(x.shape[0]):
        rope_one(x[t], cos[t], sin[t], neox, out[t])


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


# -- one decode step of a layer in one call (NumbaBackend.make_decoder): the kernels above, in the order and
# with the arguments the op-by-op path gives them, so that the logits are the same to the bit ---------------
@nb.njit(inline="always")
def run_end(codes, j, j1):
    """Where the run of members of codes[j]'s type that starts at j ends (j1 at most)."""
    e = j + 1
    while e < j1 and codes[e] == codes[j]:
        e += 1
    return e


def members_times(codes, n_blocks, rows, bounds, j0, j1, x, one_type):
    """x [1, K] times members j0..j1-1 of a layer's matrices (member j: blocks of type code codes[j], n_blocks[j] of
    them a row, its rows' addresses rows[bounds[j]:bounds[j + 1]]) -> [1, N]: consecutive members of one type by one
    matmul_rows call (stacked, as KernelBlocks stacks a group), each row as its own matrix's product computes it.
    one_type: a literal type code (decode_step_for's) when every member has that type: one matmul_rows call made for
    that type, its loops alone; -1 or a runtime value: the runs of one type as codes gives them. Compiled code only:
    numba picks the implementation where it types the call (_members_times)."""
    raise NotImplementedError("members_times runs inside numba code only")


@overload(members_times, prefer_literal=True)
def _members_times(codes, n_blocks, rows, bounds, j0, j1, x, one_type):
    if isinstance(one_type, types.IntegerLiteral) and one_type.literal_value >= 0:
        code = one_type.literal_value

        def of_one_type(codes, n_blocks, rows, bounds, j0, j1, x, one_type):
            out = np.empty((1, bounds[j1] - bounds[j0]), np.float32)
            matmul_rows(code, rows[bounds[j0]:bounds[j1]], n_blocks[j0], x, out)
            return out
        return of_one_type

    def by_runs(codes, n_blocks, rows, bounds, j0, j1, x, one_type):
        out = np.empty((1, bounds[j1] - bounds[j0]), np.float32)
        single = run_end(codes, j0, j1) == j1              # one type: one call, straight into out
        j = j0
        while j < j1:                                      # one call site: matmul_rows compiled into this code once
            e = run_end(codes, j, j1)
            part = out if single else np.empty((1, bounds[e] - bounds[j]), np.float32)
            matmul_rows(codes[j], rows[bounds[j]:bounds[e]], n_blocks[j], x, part)
            if not single:
                out[0, bounds[j] - bounds[j0]:bounds[e] - bounds[j0]] = part[0]
            j = e
        return out
    return by_runs


@nb.njit(cache=True)
def member_bounds(nq, nk, d, nf):
    """Where each of a layer's 7 matrices (Q, K, V, output, gate, up, down) starts in its stacked rows, and the end."""
    return np.cumsum(np.array([0, nq, nk, nk, d, nf, nf, d], np.int64))


@nb.njit(cache=True)
def group_edges():
    """Where a layer's four products start among its 7 matrices (Q/K/V, output, gate/up, down), and the end: an
    array, not constants, so that members_times is compiled once and not for each pair of literal members."""
    return np.array([0, 3, 4, 6, 7], np.int64)


@nb.njit(cache=True)
def decode_layer(x, attn_norm, ffn_norm, eps, codes, n_blocks, rows, bounds, edges, nq, nk, nf, cos, sin, neox,
                 kc, vc, pos, scale, kv_head, parallel_attention, one_type):
    """One token through one llama layer: x [1, D] f32 -> [1, D]; writes K and V at `pos` of kc, vc [n_ctx, KV,
    Hd]. codes, n_blocks [7]: the type code and blocks a row of Q, K, V, output, gate, up, down; rows: their rows'
    addresses, in that order (nq, nk, nk, D, nf, nf, D rows): members_times runs Q/K/V and gate/up stacked where
    they share a type (bounds: member_bounds, where each starts; edges: group_edges)."""
    n_kv, hd = kc.shape[1], kc.shape[2]
    h = np.empty_like(x)
    rms_norm_rows(x, attn_norm, eps, h)
    y = members_times(codes, n_blocks, rows, bounds, edges[0], edges[1], h, one_type)
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
    x = x + members_times(codes, n_blocks, rows, bounds, edges[1], edges[2], att.reshape(1, nq), one_type)
    h = np.empty_like(x)
    rms_norm_rows(x, ffn_norm, eps, h)
    gu = members_times(codes, n_blocks, rows, bounds, edges[2], edges[3], h, one_type)
    hid = np.empty((1, nf), np.float32)
    silu_mul(np.ascontiguousarray(gu[0, :nf]), np.ascontiguousarray(gu[0, nf:2 * nf]), hid[0])
    return x + members_times(codes, n_blocks, rows, bounds, edges[3], edges[4], hid, one_type)


@nb.njit(cache=True)
def decode_step(x, attn_norms, ffn_norms, eps, codes, n_blocks, rows, nq, nk, nf, cos, sin, neox, kc, vc, pos,
                scale, kv_head, parallel_attention, one_type):
    """Every layer of a one-token step: decode_layer for layer i with its norms (attn_norms, ffn_norms: [L, D]) and
    its matrices (codes, n_blocks: [L, 7]; rows: [L, N] row addresses), K/V at `pos` of kc, vc [L, n_ctx, KV, Hd].
    one_type: the type code of every matrix, or -1 where they differ (see decode_step_for)."""
    bounds, groups = member_bounds(nq, nk, x.shape[1], nf), group_edges()
    for i in range(attn_norms.shape[0]):
        x = decode_layer(x, attn_norms[i], ffn_norms[i], eps, codes[i], n_blocks[i], rows[i], bounds, groups, nq, nk,
                         nf, cos, sin, neox, kc[i], vc[i], pos, scale, kv_head, parallel_attention, one_type)
    return x


STEP_FOR = {}         # one_type -> decode_step_for(one_type)'s kernel, made on first use


def decode_step_for(one_type):
    """decode_step with one_type a constant (numba compiles, and caches, one per value): for a model whose every
    layer matrix has one type, that type's loops alone (the default model's step: 0.6 MB of machine code and bitcode
    loaded on its first decode against the all-type step's 1.16 MB; that first request 0.072 s beyond a warm one
    against 0.092 on Zen 5); -1 for a model whose types differ. Takes decode_step's arguments but one_type."""
    one_type = int(one_type)
    if one_type not in STEP_FOR:
        STEP_FOR[one_type] = _step_of(one_type)
    return STEP_FOR[one_type]


def _step_of(one_type):
    @nb.njit(cache=True)
    def decode_step_of_type(x, attn_norms, ffn_norms, eps, codes, n_blocks, rows, nq, nk, nf, cos, sin, neox, kc, vc,
                            pos, scale, kv_head, parallel_attention):
        return decode_step(x, attn_norms, ffn_norms, eps, codes, n_blocks, rows, nq, nk, nf, cos, sin, neox, kc, vc,
                           pos, scale, kv_head, parallel_attention, one_type)
    return decode_step_of_type
