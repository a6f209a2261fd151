"""Numba kernels: matrix-vector products straight from GGUF blocks (decode reads the quantized bytes).

Each output row is computed by one thread (prange over rows), so results do not depend on the thread
count; fastmath is off; every kernel is compiled once and cached on disk (cache=True). Block sums are
float32 (32 products in order), accumulated over blocks in float64.
"""
from __future__ import annotations

import numba as nb
import numpy as np


# Layout: the quantized values are stored block-major and row-minor, qs[b, j, n]. Within a block, each
# output row's sum runs over j in order in a register (a constant trip count the compiler unrolls), and
# the loop over rows n around it is what gets vectorized: independent sums, so fastmath stays off. Rows
# are split into chunks, one chunk a thread.

@nb.njit(parallel=True, cache=True, fastmath=False)
def matvec_q4_0(qs, d, x, out, n_chunks):
    """qs: [B, 16, N] uint8, d: [B, N] f32, x: [B*32] f32 -> out: [N] f32 (w = d * (nibble - 8))."""
    n_blocks, _, n_rows = qs.shape
    for c in nb.prange(n_chunks):
        lo, hi = c * n_rows // n_chunks, (c + 1) * n_rows // n_chunks
        acc = np.zeros(hi - lo, dtype=np.float64)
        for b in range(n_blocks):
            xb, qb = x[b * 32: b * 32 + 32], qs[b]
            for n in range(lo, hi):
                s = np.float32(0.0)
                for j in range(16):
                    q = qb[j, n]
                    s += np.float32(np.int32(q & 15) - 8) * xb[j] + np.float32(np.int32(q >> 4) - 8) * xb[j + 16]
                acc[n - lo] += d[b, n] * s
        for n in range(lo, hi):
            out[n] = acc[n - lo]


@nb.njit(cache=True)
def _block_sums(x, gs):
    """x: [G*gs] f32 -> [G] f32 sums of each group, in order (float32, as the kernels' c * sum(x) terms)."""
    n = x.shape[0] // gs
    out = np.empty(n, dtype=np.float32)
    for g in range(n):
        t = np.float32(0.0)
        for j in range(gs):
            t += x[g * gs + j]
        out[g] = t
    return out


@nb.njit(parallel=True, cache=True, fastmath=False)
def matvec_q4_1(qs, d, m, x, out, n_chunks):
    """qs: [B, 16, N] uint8, d, m: [B, N] f32, x: [B*32] f32 -> out: [N] f32 (w = d * nibble + m)."""
    n_blocks, _, n_rows = qs.shape
    xsum = _block_sums(x, 32)
    for c in nb.prange(n_chunks):
        lo, hi = c * n_rows // n_chunks, (c + 1) * n_rows // n_chunks
        acc = np.zeros(hi - lo, dtype=np.float64)
        for b in range(n_blocks):
            xb, qb = x[b * 32: b * 32 + 32], qs[b]
            for n in range(lo, hi):
                s = np.float32(0.0)
                for j in range(16):
                    q = qb[j, n]
                    s += np.float32(q & 15) * xb[j] + np.float32(q >> 4) * xb[j + 16]
                acc[n - lo] += d[b, n] * s + m[b, n] * xsum[b]
        for n in range(lo, hi):
            out[n] = acc[n - lo]


@nb.njit(parallel=True, cache=True, fastmath=False)
def matvec_q8_0(qs, d, x, out, n_chunks):
    """qs: [B, 32, N] int8, d: [B, N] f32, x: [B*32] f32 -> out: [N] f32 (w = d * q)."""
    n_blocks, _, n_rows = qs.shape
    for c in nb.prange(n_chunks):
        lo, hi = c * n_rows // n_chunks, (c + 1) * n_rows // n_chunks
        acc = np.zeros(hi - lo, dtype=np.float64)
        for b in range(n_blocks):
            xb, qb = x[b * 32: b * 32 + 32], qs[b]
            for n in range(lo, hi):
                s = np.float32(0.0)
                for j in range(32):
                    s += np.float32(qb[j, n]) * xb[j]
                acc[n - lo] += d[b, n] * s
        for n in range(lo, hi):
            out[n] = acc[n - lo]


@nb.njit(parallel=True, cache=True, fastmath=False)
def rms_norm_rows(x, w, eps, out):
    """x: [T, D] f32, w: [D] -> out: [T, D]; sum of squares in float64 (as the NumPy reference)."""
    t, dim = x.shape
    for i in nb.prange(t):
        ss = 0.0
        for j in range(dim):
            v = x[i, j] * x[i, j]
            ss += v
        scale = np.float32(1.0) / np.sqrt(np.float32(ss / dim) + np.float32(eps))
        for j in range(dim):
            out[i, j] = (x[i, j] * scale) * w[j]


@nb.njit(parallel=True, cache=True, fastmath=False)
def silu_mul(g, u, out):
    """out = g / (1 + exp(-g)) * u, elementwise over [T, F] f32."""
    t, f = g.shape
    for i in nb.prange(t):
        for j in range(f):
            v = g[i, j]
            out[i, j] = v / (np.float32(1.0) + np.exp(-v)) * u[i, j]


@nb.njit(inline="always")
def _affine_chunk(qs, a, c, x, xsum, acc, lo, hi, gs):
    """One chunk of rows of matvec_affine_u8; gs is a constant at each call site, so the j loop unrolls."""
    for g in range(qs.shape[0]):
        xg, qg = x[g * gs: g * gs + gs], qs[g]
        for n in range(lo, hi):
            s = np.float32(0.0)
            for j in range(gs):
                s += np.float32(qg[j, n]) * xg[j]
            acc[n - lo] += a[g, n] * s + c[g, n] * xsum[g]


@nb.njit(parallel=True, cache=True, fastmath=False)
def matvec_affine_u8(qs, a, c, x, out, n_chunks):
    """qs: [G, S, N] uint8 codes, a, c: [G, N] f32, x: [G*S] f32 -> out[n] = sum_g a*sum_j q*x + c*sum_j x.

    Serves K-quants after unpacking: w = a * q + c per group of S elements (S = 32 for Q4_K/Q5_K with
    a = d*scale, c = -dmin*min; S = 16 for Q6_K with a = d*scale, c = -32*d*scale)."""
    gs, n_rows = qs.shape[1], qs.shape[2]
    xsum = _block_sums(x, gs)
    for ci in nb.prange(n_chunks):
        lo, hi = ci * n_rows // n_chunks, (ci + 1) * n_rows // n_chunks
        acc = np.zeros(hi - lo, dtype=np.float64)
        if gs == 32:
            _affine_chunk(qs, a, c, x, xsum, acc, lo, hi, 32)
        elif gs == 16:
            _affine_chunk(qs, a, c, x, xsum, acc, lo, hi, 16)
        else:
            _affine_chunk(qs, a, c, x, xsum, acc, lo, hi, gs)
        for n in range(lo, hi):
            out[n] = acc[n - lo]
