"""The feed-forward network over spans of rows: a long prompt's [T, F] products (gate, up, their activation and
product: about 940 MB at 4,096 tokens of a Llama-3-8B-shaped model, F 14,336) never held whole.

Each row's FFN depends on that row alone, so any ops' `swiglu`, `geglu` or `gelu_mlp` run on rows a..b gives
those rows' results; the spans fall on BLAS's row unit (attention_chunks.row_spans), so they are one call's
bits on one BLAS thread, and on the numba kernels (rows computed alone) always: tests/test_ffn_chunks.py.

    ffn_in_spans(xp, glu, x, *weights, keep=None, limit=None) -> (out [T, D], hidden)
    with_chunked_ffn(ops, keep="fit", n_rows=None) -> ops whose FFNs run so (the other functions are ops' own)
"""
from __future__ import annotations

from .attention_chunks import row_spans

SPAN_ELEMENTS = 1 << 24           # rows x F hidden values per span: 64 MiB of float32
GLUS = ("swiglu", "geglu", "gelu_mlp")


def hidden_width(w) -> int | None:
    """The FFN's hidden size F: the rows of its first matrix (gate, or up for GPT-2), None where unknown."""
    shape = getattr(w, "shape", None)
    return int(shape[0]) if shape is not None and len(shape) == 2 else None


def ffn_in_spans(xp, glu, x, *weights, keep=None, limit: int | None = None):
    """x: [T, D] -> (out [T, D], hidden): glu(xp, x[a:b], *weights) over spans of about limit / F rows (one call
    where T x F is within limit). keep: the rows (increasing indices into T) whose hidden [len(keep), F] comes
    back; None: every row ([T, F]); an empty tuple: none (hidden None); "fit": every row where one call takes
    them all, none beyond. limit: default SPAN_ELEMENTS."""
    t, f, limit = x.shape[0], hidden_width(weights[0]), limit or SPAN_ELEMENTS
    spans = row_spans(t, max(1, limit // f)) if f else [(0, t)]
    if isinstance(keep, str):
        keep = None if len(spans) == 1 else ()
    if len(spans) == 1:
        out, hidden = glu(xp, x, *weights)
        if keep is None:
            return out, hidden
        return out, (hidden[xp.asarray(keep)] if len(keep) else None)
    outs, hiddens = [], []
    rows = None if keep is None else [int(r) for r in keep]
    for a, b in spans:
        o, h = glu(xp, x[a:b], *weights)
        outs.append(o)
        if rows is None:
            hiddens.append(h)
        else:
            sel = [r - a for r in rows if a <= r < b]
            if sel:
                hiddens.append(h[xp.asarray(sel)])
        del h
    out = xp.concatenate(outs, axis=0)
    return out, (xp.concatenate(hiddens, axis=0) if hiddens else None)


class with_chunked_ffn:
    """ops (a module or namespace of layer functions) whose FFNs (GLUS) run ffn_in_spans over ops' own; every
    other name is ops' own. keep: the rows whose hidden comes back, of a forward over n_rows rows (an FFN over
    other rows, a last layer's kept rows, returns all of its own); "fit" (default): as ffn_in_spans (a forward
    nobody records)."""

    def __init__(self, ops, keep="fit", n_rows: int | None = None, limit: int | None = None):
        self._ops, self._keep, self._n, self._limit = ops, keep, n_rows, limit

    def __getattr__(self, name):
        if name in GLUS:
            glu = getattr(self._ops, name)
            return lambda xp, x, *weights: self._spans(glu, xp, x, weights)
        return getattr(self._ops, name)

    def _spans(self, glu, xp, x, weights):
        keep = self._keep
        if not isinstance(keep, str) and self._n is not None and x.shape[0] != self._n:
            keep = None
        return ffn_in_spans(xp, glu, x, *weights, keep=keep, limit=self._limit)
