"""Attention over query rows a chunk at a time: the scores of a long prompt (H x T x S floats, 2.3 GB at 8,000
tokens on a 9-head model, several copies while the softmax runs) never held whole.

Each query row's scores, softmax and weighted sum depend on that row and the keys alone, so any ops'
`attention(xp, q, k, v, mask, scale, kv_head)` (the reference's model.layers.attention, ggml's emulation)
run on rows a..b gives those rows' results: tests/test_long_memory.py checks them bit for bit against one call.

    attention_in_chunks(xp, attention, q, k, v, mask, scale, kv_head, keep=None) -> (out, kq, probs)
    with_chunked_attention(ops, keep=None) -> ops whose attention runs so (the other functions are ops' own)
"""
from __future__ import annotations

import functools

CHUNK_ELEMENTS = 1 << 24          # H x rows x S scores per chunk: 64 MiB of float32


MIN_ROWS = 64                     # BLAS takes another path for a product of a few rows: never fewer per chunk
UNITS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)      # the row blocks a BLAS kernel may compute as one panel


@functools.lru_cache(maxsize=1)
def row_unit() -> int:
    """The rows of one panel of NumPy's BLAS matrix product, probed once on one thread: a product of rows a..b
    gives one call's bits for those rows where a and b are multiples of it (OpenBLAS's Haswell kernels on an AMD
    EPYC: 12; a row's sums depend on its place in a panel, so rows 0..149 of 300 differ in the last bit). Chunk
    and span boundaries fall on its multiples. With several BLAS threads, OpenBLAS splits one call's rows
    among them at places that follow the row count, and no boundary gives one call's bits on such a CPU."""
    import numpy as np
    from threadpoolctl import threadpool_limits

    rng = np.random.default_rng(0)
    a = rng.standard_normal((500, 64)).astype(np.float32)      # 500 rows: a tail after every unit's panels
    b = rng.standard_normal((64, 96)).astype(np.float32)
    with threadpool_limits(limits=1, user_api="blas"):
        whole = a @ b
        for u in UNITS:
            if all(np.array_equal(a[i:i + n] @ b, whole[i:i + n]) for n in (u, 2 * u, 3 * u, 5 * u)
                   for i in range(0, 500, n)):
                return u
    return 1                          # none found: no alignment gives one call's bits; any boundary will do


def aligned_rows(rows: int) -> int:
    """rows rounded up to a multiple of BLAS's row unit (row_unit)."""
    u = row_unit()
    return -(-rows // u) * u


def chunk_rows(n_heads: int, t: int, s: int, limit: int = CHUNK_ELEMENTS) -> int:
    """The query rows of one chunk: as many as keep H x rows x S within `limit` but at least MIN_ROWS (a product
    of a few rows runs another BLAS kernel, whose sums differ in the last bit), evened out over the chunks, then
    rounded up to BLAS's row unit (row_unit: the boundaries where a chunk's sums are one call's); t (one call)
    for a short prompt."""
    step = max(MIN_ROWS, limit // max(1, n_heads * s))
    if step >= t or t < 2 * MIN_ROWS:
        return t
    n = -(-t // step)
    return min(t, aligned_rows(-(-t // n)))


def row_spans(t: int, span: int) -> list[tuple[int, int]]:
    """[(a, b)] covering rows 0..t-1 in spans of about `span` rows, evened out and rounded up to BLAS's row unit
    (row_unit), none under MIN_ROWS (a product of a few rows runs another BLAS kernel) but the last; one span
    where t is short."""
    n = max(1, min(-(-t // max(span, 1)), t // MIN_ROWS))
    step = min(t, aligned_rows(-(-t // n)))
    return [(a, min(t, a + step)) for a in range(0, t, step)]


def attention_in_chunks(xp, attention, q, k, v, mask, scale, kv_head, keep=None, limit: int = CHUNK_ELEMENTS):
    """q: [T, H, Hd], k/v: [S, KV, Hd], mask: [T, S] -> (out [T, H*Hd], kq, probs). keep: the query rows
    (indices into T, increasing) whose raw scores and probabilities come back as [H, len(keep), S]; None: every
    row ([H, T, S]); an empty tuple: none (kq and probs None); "fit": every row where one call takes them all,
    none beyond. One call where H x T x S is within `limit`."""
    t, s, h = q.shape[0], k.shape[0], len(kv_head)
    step = chunk_rows(h, t, s, limit)
    if isinstance(keep, str):
        keep = None if step >= t else ()
    if step >= t:
        out, kq, probs = attention(xp, q, k, v, mask, scale, kv_head)
        if keep is None:
            return out, kq, probs
        if len(keep) == 0:
            return out, None, None
        sel = xp.asarray(keep)
        return out, kq[:, sel], probs[:, sel]
    outs, kqs, prs = [], [], []
    rows = None if keep is None else [int(r) for r in keep]
    for a in range(0, t, step):
        b = min(t, a + step)
        o, kq, probs = attention(xp, q[a:b], k, v, mask[a:b], scale, kv_head)
        outs.append(o)
        if rows is None:
            kqs.append(kq)
            prs.append(probs)
        else:
            sel = [r - a for r in rows if a <= r < b]
            if sel:
                kqs.append(kq[:, xp.asarray(sel)])
                prs.append(probs[:, xp.asarray(sel)])
        del kq, probs
    out = xp.concatenate(outs, axis=0)
    if rows is not None and not rows:
        return out, None, None
    return out, xp.concatenate(kqs, axis=1), xp.concatenate(prs, axis=1)


class with_chunked_attention:
    """ops (a module or namespace of layer functions) whose `attention` runs attention_in_chunks over ops' own
    attention; every other name is ops' own. keep: as attention_in_chunks (default "fit": the scores where
    one call holds them, a long prompt's not at all)."""

    def __init__(self, ops, keep="fit", limit: int = CHUNK_ELEMENTS):
        self._ops, self._keep, self._limit = ops, keep, limit

    def __getattr__(self, name):
        return getattr(self._ops, name)

    def attention(self, xp, q, k, v, mask, scale, kv_head):
        return attention_in_chunks(xp, self._ops.attention, q, k, v, mask, scale, kv_head, keep=self._keep,
                                   limit=self._limit)
