"""Attention over query rows a chunk at a time: the scores of a long prompt (H x T x S floats, 2.3 GB at 8,000
tokens on a 9-head model, several copies while the softmax runs) never held whole.

Each query row's scores, softmax and weighted sum depend on that row and the keys alone, so any ops'
`attention(xp, q, k, v, mask, scale, kv_head)` (the reference's model.layers.attention, ggml's emulation)
run on rows a..b gives those rows' results: tests/test_long_memory.py checks them bit for bit against one call.

    attention_in_chunks(xp, attention, q, k, v, mask, scale, kv_head, keep=None) -> (out, kq, probs)
    with_chunked_attention(ops, keep=None) -> ops whose attention runs so (the other functions are ops' own)
"""
from __future__ import annotations

CHUNK_ELEMENTS = 1 << 24          # H x rows x S scores per chunk: 64 MiB of float32


MIN_ROWS = 64                     # BLAS takes another path for a product of a few rows: never fewer per chunk


def chunk_rows(n_heads: int, t: int, s: int, limit: int = CHUNK_ELEMENTS) -> int:
    """The query rows of one chunk: as many as keep H x rows x S within `limit` but at least MIN_ROWS (a product
    of a few rows runs another BLAS kernel, whose sums differ in the last bit), then evened out over the chunks
    (none shorter than the others by more than a row, none under 43); t (one call) for a short prompt."""
    step = max(MIN_ROWS, limit // max(1, n_heads * s))
    if step >= t or t < 2 * MIN_ROWS:
        return t
    n = -(-t // step)
    return -(-t // n)


def row_spans(t: int, span: int) -> list[tuple[int, int]]:
    """[(a, b)] covering rows 0..t-1 in spans of about `span` rows, as even as the rows allow (none longer than
    another by more than a row) and none under MIN_ROWS (a product of a few rows runs another BLAS kernel); one
    span where t is short."""
    n = max(1, min(-(-t // max(span, 1)), t // MIN_ROWS))
    return [(t * i // n, t * (i + 1) // n) for i in range(n)]


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
