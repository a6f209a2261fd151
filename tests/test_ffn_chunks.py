"""The FFN over spans of rows (model/ffn_chunks.py): one call's bits wherever the spans start on BLAS's row unit,
the hidden kept only at the rows asked for, and a reference dump whose FFNs ran in spans equal to one whose did
not, tensor for tensor."""
from __future__ import annotations

import numpy as np
import pytest

import llorch_ref
from llorch_ref.model import ffn_chunks as FC
from llorch_ref.model import layers as L
from llorch_ref.model.attention_chunks import row_spans
from llorch_ref.references.llorch import record_engine

D, F, T = 64, 96, 300
LIMIT = 64 * F                     # spans of about 64 rows


def weights(glu, seed=0):
    rng = np.random.default_rng(seed)
    m = lambda n, k: (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)  # noqa: E731
    if glu is L.gelu_mlp:                                    # w_up, b_up, w_down, b_down
        return m(F, D), rng.standard_normal(F).astype(np.float32), m(D, F), rng.standard_normal(D).astype(np.float32)
    return m(F, D), m(F, D), m(D, F)                         # w_gate, w_up, w_down


@pytest.mark.parametrize("glu", [L.swiglu, L.geglu, L.gelu_mlp], ids=["swiglu", "geglu", "gelu_mlp"])
def test_the_ffn_in_spans_is_bit_equal_to_one_call(glu, one_blas_thread):
    x = np.random.default_rng(1).standard_normal((T, D)).astype(np.float32)
    w = weights(glu)
    whole_out, whole_hidden = glu(np, x, *w)
    assert len(row_spans(T, LIMIT // F)) > 2                             # it does run in spans
    out, hidden = FC.ffn_in_spans(np, glu, x, *w, limit=LIMIT)
    assert np.array_equal(out, whole_out) and np.array_equal(hidden, whole_hidden)
    keep = [0, 7, 90, 91, 250, T - 1]
    out, hidden = FC.ffn_in_spans(np, glu, x, *w, keep=keep, limit=LIMIT)
    assert np.array_equal(out, whole_out) and np.array_equal(hidden, whole_hidden[keep])
    out, hidden = FC.ffn_in_spans(np, glu, x, *w, keep=(), limit=LIMIT)
    assert np.array_equal(out, whole_out) and hidden is None


def test_a_planted_change_in_one_span_is_found_at_that_span_s_rows_only(one_blas_thread):
    x = np.random.default_rng(1).standard_normal((T, D)).astype(np.float32)
    w = weights(L.swiglu)
    whole = L.swiglu(np, x, *w)[0]
    calls = []

    def off_in_second_span(xp, x_, wg, wu, wd):
        calls.append(1)
        return L.swiglu(xp, x_, wg * np.float32(1.001 if len(calls) == 2 else 1.0), wu, wd)
    out, _ = FC.ffn_in_spans(np, off_in_second_span, x, *w, limit=LIMIT)
    a, b = row_spans(T, LIMIT // F)[1]
    bad = np.flatnonzero(np.any(out != whole, axis=1))
    assert bad.size and bad.min() >= a and bad.max() < b


def test_a_forward_nobody_records_keeps_no_hidden_beyond_one_call():
    x = np.ones((T, D), np.float32)
    w = weights(L.swiglu)
    assert FC.with_chunked_ffn(L, limit=LIMIT).swiglu(np, x, *w)[1] is None
    assert FC.with_chunked_ffn(L, limit=T * F).swiglu(np, x, *w)[1].shape == (T, F)   # one call: all of it
    # a forward's last layer, on its kept rows only: their hidden, whatever the rows kept
    kept = FC.with_chunked_ffn(L, keep=[3, 9], n_rows=T, limit=LIMIT)
    assert kept.swiglu(np, x[:2], *w)[1].shape == (2, F)
    assert kept.swiglu(np, x, *w)[1].shape == (2, F)


@pytest.mark.parametrize("backend", ["numpy", "numba"])
def test_a_dump_whose_ffns_ran_in_spans_is_one_call_s(tiny, backend, monkeypatch, one_blas_thread):
    if backend == "numba":
        pytest.importorskip("numba")
    path = tiny(weight_type="Q8_0", n_layers=2, vocab="bpe", context_length=512)
    eng = llorch_ref.load(path, backend=backend)
    ids = [int(t) for t in np.random.default_rng(1).integers(3, 120, size=T)]
    rows = list(range(0, T, 37)) + [T - 1]
    whole = record_engine(eng, ids, n_greedy=2, rows=rows)
    f = eng.config.d_ff
    spans = []
    real = FC.ffn_in_spans

    def counted(xp, glu, x, *w, keep=None, limit=None):
        spans.append(len(row_spans(x.shape[0], max(1, (limit or FC.SPAN_ELEMENTS) // f))))
        return real(xp, glu, x, *w, keep=keep, limit=limit)
    monkeypatch.setattr(FC, "SPAN_ELEMENTS", 64 * f)
    monkeypatch.setattr(FC, "ffn_in_spans", counted)
    chunked = record_engine(eng, ids, n_greedy=2, rows=rows)
    assert max(spans) > 2                                                # the prompt's FFNs ran in spans
    assert set(chunked.tensors) == set(whole.tensors)
    for name, a in whole.tensors.items():
        assert np.array_equal(chunked.tensors[name], a), name
    assert chunked.tensors["cp6.ffn_swiglu.layer0"].shape == (len(rows), f)
