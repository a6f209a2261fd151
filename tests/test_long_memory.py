"""Long contexts at bounded memory: attention in query-row chunks (bit-equal to one call), dumps written to disk
as they are recorded and read back one tensor at a time (the arrays held do not grow with the layers), the
attention scores held at sampled rows, model tensors [T, V] compared a span of rows at a time (compare's
figures), and llama.cpp fed in batches (the same tensors)."""
from __future__ import annotations

import math
import sys

import numpy as np
import pytest

import llorch_ref
from llorch_ref.dump import default_score_rows
from llorch_ref.errors import HarnessError
from llorch_ref.harness import compare as C
from llorch_ref.harness.compare import compare_by_spans, compare_dumps
from llorch_ref.harness.metrics import compare
from llorch_ref.harness.run import run_subject
from llorch_ref.model import layers as L
from llorch_ref.model.attention_chunks import attention_in_chunks, chunk_rows, row_spans
from llorch_ref.model.cache import visible_mask
from llorch_ref.model.forward import LOGIT_SPAN
from llorch_ref.numerics.ggml_cpu import make_attention
from llorch_ref.references.llorch import record_engine
from llorch_ref.tensor_file import SpillStore

TEXT = ("The history of the Roman Empire spans many centuries, from the founding of the city to the fall of "
        "Constantinople in 1453, and its")


def qkv(t, s, h=9, kv=3, hd=64, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((t, h, hd)).astype(np.float32)
    k, v = (rng.standard_normal((s, kv, hd)).astype(np.float32) for _ in range(2))
    mask = visible_mask(np, np.arange(s - t, s)[:, None], np.arange(s)[None, :], 0).astype(np.float32)
    return q, k, v, mask, L.kv_head_of(np, h, kv)


@pytest.mark.parametrize("attention", [L.attention, make_attention("float32"), make_attention("float16")],
                         ids=["exact", "ggml-f32", "ggml-f16"])
def test_attention_in_query_row_chunks_is_bit_equal_to_one_call(attention, one_blas_thread):
    q, k, v, mask, kvh = qkv(300, 400)
    whole = attention(np, q, k, v, mask, 0.125, kvh)
    keep = [0, 5, 131, 200, 299]
    for limit in (9 * 400 * 64, 9 * 400 * 150):
        assert chunk_rows(9, 300, 400, limit) < 300                       # it does run in chunks
        out, kq, probs = attention_in_chunks(np, attention, q, k, v, mask, 0.125, kvh, limit=limit)
        assert np.array_equal(out, whole[0]) and np.array_equal(kq, whole[1]) and np.array_equal(probs, whole[2])
        out, kq, probs = attention_in_chunks(np, attention, q, k, v, mask, 0.125, kvh, keep=keep, limit=limit)
        assert np.array_equal(out, whole[0])
        assert np.array_equal(kq, whole[1][:, keep]) and np.array_equal(probs, whole[2][:, keep])
    out, kq, probs = attention_in_chunks(np, attention, q, k, v, mask, 0.125, kvh, keep=(), limit=9 * 400 * 64)
    assert np.array_equal(out, whole[0]) and kq is None and probs is None


def test_a_planted_change_in_one_chunk_is_not_bit_equal(one_blas_thread):
    q, k, v, mask, kvh = qkv(300, 300)
    whole = L.attention(np, q, k, v, mask, 0.125, kvh)

    calls = []

    def off_in_second_chunk(xp, q_, k_, v_, m_, scale, kvh_):
        calls.append(1)
        return L.attention(xp, q_, k_, v_, m_, scale * (1.001 if len(calls) == 2 else 1.0), kvh_)
    step = chunk_rows(9, 300, 300, 9 * 300 * 100)
    out, _, _ = attention_in_chunks(np, off_in_second_chunk, q, k, v, mask, 0.125, kvh, limit=9 * 300 * 100)
    bad = np.flatnonzero(np.any(out != whole[0], axis=1))
    assert bad.size and bad.min() >= step and bad.max() < 2 * step   # the second chunk's rows, and only them


def test_a_spill_store_reads_back_what_it_holds_and_keeps_nothing():
    st = SpillStore()
    a = np.arange(24, dtype=np.float32).reshape(6, 4)
    st["x"] = a
    st.write_rows("y", (6, 4), np.float32, [a[:2], a[2:]])
    assert np.array_equal(st["x"], a) and np.array_equal(st["y"], a)
    assert np.array_equal(st.read_rows("x", 2, 5, 6), a[2:5]) and st.shape("y") == [6, 4]
    assert st.live == 0 and st.peak_live >= 1                         # what was read is gone when dropped
    b = st["x"]
    assert st.live == 1
    del b
    assert st.live == 0


@pytest.fixture(scope="module")
def models(tiny):
    return {n: tiny(weight_type="F32", n_layers=n, vocab="bpe") for n in (2, 6)}


def spilled_comparison(path, planted=None):
    eng = llorch_ref.load(path, weights="eager")
    ids = eng.tokenizer.encode(TEXT)
    stores = SpillStore(), SpillStore()
    ref = record_engine(eng, ids, prompt=TEXT, n_greedy=0, store=stores[1])
    sub = record_engine(eng, ids, prompt=TEXT, n_greedy=0, store=stores[0])
    if planted:
        stores[0][planted[0]] = planted[1](stores[0][planted[0]])
    res = compare_dumps(sub, ref, eng.config, "F32")
    return res, stores


def test_a_comparison_from_disk_holds_one_tensor_at_a_time_whatever_the_layers(models):
    peaks = {}
    for n, path in models.items():
        res, stores = spilled_comparison(path)
        assert res.first_divergence is None and all(r.metrics.get("max_abs", 0.0) == 0.0 for r in res.rows
                                                    if r.checkpoint != "11")
        assert sum(r.layer is not None for r in res.rows) > 10 * n            # every layer compared
        assert all(s.live == 0 for s in stores)                              # nothing read is still held
        held = {k: v for k, v in dict.items(res.captures_ours) if ".layer" in k}
        assert len(held) > 10 * n and not any(isinstance(v, np.ndarray) for v in held.values())   # read when asked
        peaks[n] = max(s.peak_live for s in stores)
    assert peaks[2] == peaks[6] <= 3, peaks                # one tensor (and a view of it) per side at a time


def test_a_comparison_from_disk_gives_the_in_memory_figures(models):
    eng = llorch_ref.load(models[2], weights="eager")
    ids = eng.tokenizer.encode(TEXT)
    ref = record_engine(eng, ids, prompt=TEXT, n_greedy=0)
    held = compare_dumps(record_engine(eng, ids, prompt=TEXT, n_greedy=0), ref, eng.config, "F32")
    res, _ = spilled_comparison(models[2])
    assert [(r.checkpoint, r.layer, r.tensor) for r in res.rows] == [(r.checkpoint, r.layer, r.tensor)
                                                                     for r in held.rows]
    assert [r.metrics for r in res.rows] == [r.metrics for r in held.rows]
    key = "cp2.q_proj.layer1"
    assert np.array_equal(res.captures_ours[key], held.captures_ours[key])   # a capture is read when asked for


def test_a_planted_change_in_a_spilled_dump_is_the_first_divergence(models):
    res, _ = spilled_comparison(models[6], planted=("cp6.ffn_out.layer4", lambda a: a * np.float32(1.01)))
    assert res.first_divergence["layer"] == 4 and res.first_divergence["tensor"] == "ffn_out"


def test_scores_are_sampled_only_where_t_by_s_is_large():
    assert default_score_rows(list(range(1024)), 1024) is None
    rows = default_score_rows(list(range(8000)), 8000)
    assert 100 <= len(rows) <= 130 and rows[0] == 0 and rows[-1] == 7999 and rows == sorted(set(rows))
    held = list(range(0, 4096, 64)) + [4095]
    assert default_score_rows(held, 4096) is None                      # 65 rows held: all of them


def test_scores_held_at_sampled_rows_are_compared_there(models, monkeypatch):
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).parent / "checkpoints"))
    import planted_bugs as B

    ref = llorch_ref.load(models[2], weights="eager")
    ids = ref.tokenizer.encode(TEXT)
    score_rows = [0, 9, len(ids) - 1]
    clean = run_subject(ref, record_engine(ref, ids, n_greedy=0, score_rows=score_rows).to_dump(), "F32")
    assert clean.first_divergence is None
    kq = [r for r in clean.rows if r.tensor == "kq"]
    assert kq and all(r.metrics["shape"][1] == 3 and r.local_passed for r in kq)
    bp = clean.by_position()
    assert len(bp["by_tensor"]["kq"]) == len(ids) and bp["positions"] == list(range(len(ids)))
    subject = llorch_ref.load(models[2], weights="eager")
    B.wrong_attention_scale(monkeypatch, subject)
    bad = run_subject(ref, record_engine(subject, ids, n_greedy=0, score_rows=score_rows).to_dump(), "F32")
    assert bad.first_divergence["checkpoint"] == "4" and bad.first_divergence["layer"] == 0


def test_two_dumps_with_other_score_rows_are_refused(models):
    eng = llorch_ref.load(models[2], weights="eager")
    ids = eng.tokenizer.encode(TEXT)
    a = record_engine(eng, ids, n_greedy=0, score_rows=[0, len(ids) - 1])
    b = record_engine(eng, ids, n_greedy=0)
    with pytest.raises(HarnessError, match="attention scores at different rows"):
        compare_dumps(a, b, eng.config, "F32")


def test_compare_by_spans_gives_compare_s_figures():
    rng = np.random.default_rng(3)
    b = rng.standard_normal((1000, 77))
    a = b + 1e-4 * rng.standard_normal(b.shape)
    a[5, 3] = b[5, 3] = np.inf
    m, per_row = compare_by_spans(lambda i, j: a[i:j], lambda i, j: b[i:j], 1000, span=64)
    want = compare(a, b)
    for k in ("max_abs", "max_rel", "nmse", "cosine"):
        assert math.isclose(m[k], want[k], rel_tol=1e-9), k
    assert m["shape"] == [1000, 77] and len(per_row) == 1000
    a[700] *= 1.5                                                       # a planted change in one row
    m, per_row = compare_by_spans(lambda i, j: a[i:j], lambda i, j: b[i:j], 1000, span=64)
    finite = [x if i != 5 else 0.0 for i, x in enumerate(per_row)]   # row 5 holds an infinity (infinite per row)
    assert int(np.argmax(finite)) == 700 and m["nmse"] > 100 * want["nmse"] and per_row[5] == math.inf
    c = a.copy()
    c[5, 3] = -np.inf
    assert compare_by_spans(lambda i, j: c[i:j], lambda i, j: b[i:j], 1000)[0]["error"] == "non-finite values differ"


def test_logits_and_probabilities_compared_by_spans_catch_a_planted_row(models, monkeypatch):
    monkeypatch.setattr(C, "SPAN_BYTES", 0)                            # every [T, X] model tensor by spans
    monkeypatch.setattr(C, "SPAN_ROWS", 4)
    res, _ = spilled_comparison(models[2])
    spans = [r for r in res.rows if r.metrics.get("by_spans")]
    assert {r.tensor for r in spans} >= {"logits", "probs"} and res.first_divergence is None
    n = len(res.token_ids)

    def plant(a):
        a = np.array(a)
        a[n - 3] += np.float32(3.0)
        return a
    res, _ = spilled_comparison(models[2], planted=("cp8.logits", plant))
    bad = {r.tensor for r in res.rows if r.diverges}
    assert "logits" in bad
    row = next(r for r in res.rows if r.tensor == "logits" and r.checkpoint == "8")
    assert int(np.argmax(row.by_position["nmse"])) == n - 3


@pytest.fixture(scope="module")
def q8(tiny):
    return tiny(weight_type="Q8_0", n_layers=3, d_model=128, d_ff=192, vocab="bpe")


@pytest.mark.llamacpp
def test_llamacpp_fed_in_batches_and_spilled_gives_the_same_dump(llamacpp, q8):
    from llorch_ref.references.engines import dump_llamacpp
    from llorch_ref.references.llamacpp import LlamaCpp

    eng = llorch_ref.load(q8, numerics="ggml")
    ids = eng.tokenizer.encode(TEXT)
    one = dump_llamacpp(q8, token_ids=ids, n_greedy=0, n_ubatch=7)
    ctx = LlamaCpp(q8, n_ctx=256, kv_dtype="float32", n_ubatch=7, n_batch=14)     # several llama_decode calls
    try:
        store = SpillStore()
        fed = dump_llamacpp(q8, token_ids=ids, n_greedy=0, n_ubatch=7, context=ctx, store=store,
                            score_rows=[0, 13, len(ids) - 1])
    finally:
        ctx.close()
    assert fed.manifest()["score_rows"] == [0, 13, len(ids) - 1] and dict.__len__(store) == len(one.tensors)
    for name, a in one.tensors.items():
        b = store[name]
        if name.startswith(("cp4.kq.", "cp4.kq_soft_max.")):
            a = a.reshape(a.shape[::-1])[:, [0, 13, len(ids) - 1]]      # ggml order: [H, T, S] reversed
            b = b.reshape(b.shape[::-1])
        assert np.array_equal(a, b), name
    assert fed.extra["capture_invariance"]["logits_max_abs_diff"] == 0.0
    res = run_subject(eng, fed.to_dump(), "Q8_0")
    assert res.first_divergence is None, res.first_divergence


@pytest.mark.llamacpp
def test_a_diff_against_llamacpp_on_disk_passes_and_holds_no_layer(llamacpp, q8, monkeypatch):
    from llorch_ref.harness import run as R

    monkeypatch.setattr(R, "ON_DISK_BYTES", 0)                         # this tiny model's dumps go to disk
    monkeypatch.setattr(C, "SPAN_BYTES", 0)
    eng = llorch_ref.load(q8, numerics="ggml")
    ids = eng.tokenizer.encode(TEXT)
    res = R.run_diff(eng, prompt=TEXT, token_ids=ids, n_greedy=4, n_ubatch=7)
    assert res.verdict().status == "PASS", res.first_divergence
    assert sum(r.layer is not None for r in res.rows) > 30 and any(r.metrics.get("by_spans") for r in res.rows)
    held = [k for k in dict.keys(res.captures_ref) if ".layer" in k]
    assert held and not any(isinstance(dict.__getitem__(res.captures_ref, k), np.ndarray) for k in held)
    assert res.captures_ref["cp2.q_proj.layer1"].shape == (len(ids), eng.config.n_heads, eng.config.head_dim)


@pytest.mark.llamacpp
def test_a_diff_gives_llamacpp_the_subject_s_threads_and_batch(llamacpp, q8, monkeypatch):
    """llama.cpp's threads follow the subject's --threads (a many-core machine runs both sides on its cores),
    its n_batch the one asked; its sums follow neither: the ggml-exact diff passes at 1 thread and at 3, fed in
    batches of one micro-batch and of three."""
    from llorch_ref.harness import run as R
    from llorch_ref.references import llamacpp as LC

    seen, real = [], LC.LlamaCpp.__init__

    def spy(self, *a, **kw):
        seen.append((kw.get("n_threads"), kw.get("n_batch")))
        real(self, *a, **kw)
    monkeypatch.setattr(LC.LlamaCpp, "__init__", spy)
    for n in (1, 3):
        eng = llorch_ref.load(q8, numerics="ggml", threads=n)
        res = R.run_diff(eng, prompt=TEXT, n_greedy=2, n_ubatch=7, n_batch=7 * n)
        assert res.verdict().status == "PASS", (n, res.first_divergence)
    assert seen == [(1, 7), (3, 21)]


def test_a_batch_smaller_than_its_micro_batch_is_refused(q8, capsys):
    from llorch_ref.cli import main

    assert main(["diff", "--model", str(q8), "--batch", "4", "--ubatch", "8", "--greedy", "0"]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and err[0].startswith("error: --batch (4) must be >= --ubatch (8)"), err
    from llorch_ref.errors import ParameterError
    from llorch_ref.references.engines import dump_llamacpp
    with pytest.raises(ParameterError, match=r"n_batch \(4\) must be >= n_ubatch \(8\)"):
        dump_llamacpp(q8, token_ids=[1, 2, 3], n_greedy=0, n_ubatch=8, n_batch=4)


@pytest.mark.llamacpp
def test_llamacpp_s_captured_parts_give_their_disk_back_as_they_are_joined(llamacpp, q8, monkeypatch):
    """A dump on disk: llama.cpp's captured parts (one file a node and micro-batch) are deleted as each tensor is
    joined into the dump, and its logits node is never copied out (they come from its output buffer): the disk
    held at once stays near one side's tensors instead of the parts and the dump both."""
    from llorch_ref import tensor_file as TF
    from llorch_ref.references.engines import dump_llamacpp

    held, peak, written, shapes = {}, [0], {"capture": 0, "dump": 0}, []
    real_set, real_del = TF.SpillStore.__setitem__, TF.SpillStore.__delitem__

    def put(self, name, a):
        real_set(self, name, a)
        n = np.asarray(a).nbytes
        held[(id(self), name)] = n
        side = "capture" if "llorch-capture-" in str(self._dir) else "dump"
        written[side] += n
        shapes.append((side, np.shape(a)))
        peak[0] = max(peak[0], sum(held.values()))

    def drop(self, name):
        held.pop((id(self), name), None)
        real_del(self, name)
    monkeypatch.setattr(TF.SpillStore, "__setitem__", put)
    monkeypatch.setattr(TF.SpillStore, "__delitem__", drop)
    ids = llorch_ref.load(q8).tokenizer.encode(TEXT)
    store = TF.SpillStore()
    dump_llamacpp(q8, token_ids=ids, n_greedy=0, n_ubatch=7, store=store)
    assert written["capture"] and written["dump"]
    assert peak[0] <= written["capture"] + 0.2 * written["dump"], (peak, written)   # not the two together
    assert sum(n for (sid, _), n in held.items() if sid != id(store)) == 0       # every part deleted
    n_vocab = llorch_ref.load(q8).config.n_vocab
    assert not [sh for side, sh in shapes if side == "capture" and n_vocab in sh]  # result_output never read


@pytest.mark.llamacpp
def test_the_last_token_logits_come_from_the_greedy_run_s_prefill(llamacpp, q8, monkeypatch):
    """cp9 (the prompt's last row alone) is the greedy run's own prefill on both sides, one prompt forward fewer,
    and the same bits as a forward of its own: llama.cpp's eval_last, llorch-ref's forward(rows=[T-1])."""
    from llorch_ref.references import llamacpp as LC
    from llorch_ref.references.engines import dump_llamacpp

    ids = llorch_ref.load(q8).tokenizer.encode(TEXT)
    prefills, real_prefill = [], LC.LlamaCpp._prefill_last
    monkeypatch.setattr(LC.LlamaCpp, "_prefill_last", lambda self, t: prefills.append(len(t)) or real_prefill(self, t))
    theirs = dump_llamacpp(q8, token_ids=ids, n_greedy=3, n_ubatch=7)
    assert prefills == [len(ids)]                                     # the greedy run's, cp9's too
    ctx = LC.LlamaCpp(q8, n_ctx=256, kv_dtype="float32", n_ubatch=7)
    try:
        assert np.array_equal(theirs.tensors["cp9.logits"].ravel(), ctx.eval_last(ids))
    finally:
        ctx.close()
    eng = llorch_ref.load(q8)
    forwards, real_forward = [], eng.forward
    monkeypatch.setattr(eng, "forward", lambda t, *a, **kw: forwards.append(len(t)) or real_forward(t, *a, **kw))
    ours = record_engine(eng, ids, n_greedy=3)
    assert forwards.count(len(ids)) == 3            # recorded, capture invariance, the greedy run (with cp9)
    alone = np.asarray(real_forward(ids, eng.new_cache(), rows=[len(ids) - 1]))[-1]
    assert np.array_equal(ours.tensors["cp9.logits"], alone)
    assert len(ours.tensors["cp12.greedy_tokens"]) == 3 and len(theirs.tensors["cp12.greedy_tokens"]) == 3


@pytest.fixture(scope="module")
def long_tiny(tiny):
    return tiny(weight_type="F32", n_layers=2, vocab="bpe", context_length=512)


def long_ids(n=300, seed=1):
    return [int(t) for t in np.random.default_rng(seed).integers(3, 120, size=n)]


def spans_of_forward(eng, ids, **kw):
    got = []
    last = eng.forward(ids, eng.new_cache(), logits_sink=lambda a, part: got.append((a, np.array(part))), **kw)
    return got, last


@pytest.mark.parametrize("numerics,backend", [("exact", "numpy"), ("ggml", "numpy"), ("exact", "numba")])
def test_the_logits_handed_over_by_spans_are_one_product_s(tiny, numerics, backend, one_blas_thread):
    if backend == "numba":
        pytest.importorskip("numba")         # its own forward: its [R, V] handed over by spans
    path = tiny(weight_type="Q8_0", n_layers=2, vocab="bpe", context_length=512)
    eng = llorch_ref.load(path, numerics=numerics, backend=backend)
    ids = long_ids()
    whole = eng.forward(ids, eng.new_cache())
    for kw in ({}, {"record": lambda n, l, a: None}, {"rows": list(range(5, 300))}):
        got, last = spans_of_forward(eng, ids, **kw)
        want = eng.forward(ids, eng.new_cache(), rows=kw["rows"]) if "rows" in kw else whole    # one product
        assert len(got) == 2 and [a for a, _ in got] == [0, got[1][0]]         # spans of the rows, in order
        assert np.array_equal(np.concatenate([p for _, p in got]), want) and np.array_equal(last, want[-1:])


class PlantedHead:
    """ops whose output product is off in one call (`at`: the 1-based call on the output matrix)."""

    def __init__(self, ops, output, at):
        self._ops, self.output, self.at, self.calls = ops, output, at, 0

    def __getattr__(self, name):
        return getattr(self._ops, name)

    def linear(self, xp, x, w):
        out = self._ops.linear(xp, x, w)
        if w is self.output:
            self.calls += 1
            if self.calls == self.at:
                out = out + np.float32(1e-3)
        return out


def test_a_spilled_recording_holds_the_in_memory_logits_probabilities_and_argmax(long_tiny, one_blas_thread):
    eng = llorch_ref.load(long_tiny, weights="eager")
    ids = long_ids()
    held = record_engine(eng, ids, n_greedy=0)
    spilled = record_engine(eng, ids, n_greedy=0, store=SpillStore())
    assert "cp8.logits" in spilled.tensors
    for name in ("cp8.logits", "cp11.probs", "cp10.argmax", "cp9.logits"):
        assert np.array_equal(spilled.tensors[name], held.tensors[name]), name
    assert spilled.extra["capture_invariance"]["logits_max_abs_diff"] == 0.0


def test_a_planted_span_of_the_recorded_logits_is_found_and_warned_of(long_tiny, one_blas_thread):
    eng = llorch_ref.load(long_tiny, weights="eager")
    ids = long_ids()
    ref = record_engine(eng, ids, n_greedy=0, store=SpillStore())
    plain = eng.ops
    eng.ops = PlantedHead(plain, eng.weights.output, at=3)         # the warm-up's product, then span 1, span 2
    try:
        sub = record_engine(eng, ids, n_greedy=0, store=SpillStore())
    finally:
        eng.ops = plain
    assert sub.extra["capture_invariance"]["logits_max_abs_diff"] > 0
    res = compare_dumps(sub.to_dump(), ref.to_dump(), eng.config, "F32")
    assert any("capture changed the computation" in w for w in res.warnings)
    row = next(r for r in res.rows if r.checkpoint == "8" and r.tensor == "logits")
    bad = np.flatnonzero(np.asarray(row.by_position["nmse"]) > 0)
    (_, _), (second, _) = row_spans(300, LOGIT_SPAN)
    assert bad.size and bad.min() == second and bad.max() == 299            # the second span's rows, and only them


@pytest.mark.llamacpp
def test_llamacpp_s_logits_handed_over_by_spans_are_its_batch_s(llamacpp, q8, monkeypatch):
    from llorch_ref.references.llamacpp import LlamaCpp

    ids = llorch_ref.load(q8).tokenizer.encode(TEXT)
    ctx = LlamaCpp(q8, n_ctx=256, kv_dtype="float32", n_ubatch=7, n_batch=14)
    try:
        whole = ctx.eval(ids)
        monkeypatch.setattr(LlamaCpp, "SINK_ROWS", 5)
        got = []
        assert ctx.eval(ids, sink=lambda a, part: got.append((a, part.copy()))) is None
    finally:
        ctx.close()
    starts = [a + j for a in range(0, len(ids), 14) for j in range(0, min(14, len(ids) - a), 5)]
    assert [a for a, _ in got] == starts and len(starts) > 4                  # 5 rows at a time within each batch
    assert np.array_equal(np.concatenate([p for _, p in got]), whole)


def test_the_schema_and_the_format_doc_describe_score_rows(models):
    import json

    from llorch_ref.checkpoints import catalogue_path
    from llorch_ref.dump import validate_manifest
    from llorch_ref.errors import DumpError

    rec = record_engine(llorch_ref.load(models[2]), [1, 2, 3], n_greedy=0, score_rows=[0, 2])
    man = rec.manifest()
    validate_manifest(man, "ok")
    for bad in ([], ["0"], [-1], [2, 2]):
        with pytest.raises(DumpError, match="score_rows"):
            validate_manifest({**man, "score_rows": bad}, "bad")
    schema = json.loads((catalogue_path() / "dump.schema.json").read_text())
    assert "score_rows" in schema["properties"]
    assert "`score_rows`" in (catalogue_path() / "DUMP_FORMAT.md").read_text()


def test_a_bundle_of_a_run_on_disk_is_written_and_verified_one_tensor_at_a_time(models, tmp_path, monkeypatch):
    from llorch_ref.harness import run as R
    from llorch_ref.harness.bundle import write_bundle
    from llorch_ref.harness.verify import verify_bundle
    from llorch_ref.tensor_file import NpzTensors

    monkeypatch.setattr(R, "ON_DISK_BYTES", 0)                 # the tiny model's dumps go to disk
    eng = llorch_ref.load(models[6], weights="eager")
    ids = eng.tokenizer.encode(TEXT)
    store = SpillStore()
    sub = record_engine(eng, ids, prompt=TEXT, n_greedy=0, store=store).to_dump()
    res = run_subject(eng, sub, "F32")
    assert res.verdict().status == "PASS"
    store.peak_live = 0
    out = write_bundle(res, eng, out_dir=tmp_path, run_id="long", plot=False, repro_case=False)
    assert store.live == 0 and 1 <= store.peak_live <= 2                # one subject tensor read at a time
    kept = NpzTensors({"cp6.ffn_out.layer4": (out["dir"] / "cp6_swiglu" / "subject.npz", "cp6.ffn_out.layer4.npy")})
    assert np.array_equal(kept["cp6.ffn_out.layer4"], store["cp6.ffn_out.layer4"])
    made, joined = [], NpzTensors.joined.__func__
    monkeypatch.setattr(NpzTensors, "joined", classmethod(lambda cls, parts, error=HarnessError:
                                                          made.append(joined(cls, parts, error)) or made[-1]))
    v = verify_bundle(out["dir"])
    assert v.ok and v.rerun["figures_hold"], v.rerun
    held = made[0]                  # the subject's tensors, read back by the re-run's comparison and the local check
    assert len(held) > 60 and held.live == 0 and 1 <= held.peak_live <= len(held) // 6     # at most a layer's


def test_tensors_read_from_an_npz_on_lookup_catch_a_planted_tensor(models, tmp_path):
    from llorch_ref.tensor_file import NpzTensors, write_npz

    eng = llorch_ref.load(models[2], weights="eager")
    ids = eng.tokenizer.encode(TEXT)
    rec = record_engine(eng, ids, prompt=TEXT, n_greedy=0)
    write_npz(tmp_path / "ok.npz", ((k, v) for k, v in rec.tensors.items()))
    planted = {k: (v * np.float32(1.01) if k == "cp2.v.layer1" else v) for k, v in rec.tensors.items()}
    write_npz(tmp_path / "bad.npz", planted.items())
    for name, fd in (("ok", None), ("bad", ("2", 1, "v"))):
        t = NpzTensors({k: (tmp_path / f"{name}.npz", f"{k}.npy") for k in rec.tensors})
        n = len(ids)
        assert t.shape("cp8.logits") == [n, eng.config.n_vocab] and t.kind("cp10.argmax") == "i"
        assert np.array_equal(t.read_rows("cp8.logits", 3, 7, n), rec.tensors["cp8.logits"][3:7])
        from llorch_ref.dump import Dump

        res = compare_dumps(Dump(manifest=rec.manifest(), tensors=t, source=name), rec.to_dump(), eng.config, "F32")
        got = res.first_divergence
        assert (got is None) if fd is None else (got["checkpoint"], got["layer"], got["tensor"]) == fd, got


def forced_chunks(monkeypatch):
    """Every attention of twice 64 rows or more (rounded up to BLAS's row unit) in chunks of that many query rows
    (a long prompt's path on a short one)."""
    from llorch_ref.model import attention_chunks as AC

    rows = AC.aligned_rows(64)
    monkeypatch.setattr(AC, "chunk_rows", lambda h, t, s, limit=0: rows if t >= 2 * rows else t)


@pytest.mark.parametrize("numerics", ["exact", "ggml"])
def test_numba_s_fused_attention_in_query_row_chunks_is_one_call_s(tiny, numerics, monkeypatch, one_blas_thread):
    pytest.importorskip("numba")
    path = tiny(weight_type="Q8_0", n_layers=2, vocab="bpe", context_length=512)
    eng = llorch_ref.load(path, backend="numba", numerics=numerics)
    ids = long_ids()
    whole = eng.forward(ids, eng.new_cache())                    # nobody records: numba's own forward
    calls = []
    from llorch_ref.model import attention_chunks as AC
    real = AC.attention_in_chunks

    def counted(*a, **kw):
        calls.append(a[3].shape[0] if len(a) > 3 else None)
        return real(*a, **kw)
    forced_chunks(monkeypatch)
    monkeypatch.setattr(sys.modules["llorch_ref.backends.numba_backend"], "attention_in_chunks", counted)
    chunked = eng.forward(ids, eng.new_cache())
    assert calls and np.array_equal(chunked, whole)


def test_the_local_check_of_sampled_scores_runs_in_chunks_with_the_same_figures(long_tiny, monkeypatch, one_blas_thread):
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).parent / "checkpoints"))
    import planted_bugs as B

    ref = llorch_ref.load(long_tiny, weights="eager")
    ids = long_ids()
    score_rows = [0, 70, 150, 299]
    sub = record_engine(ref, ids, n_greedy=0, score_rows=score_rows).to_dump()
    one = run_subject(ref, sub, "F32")
    forced_chunks(monkeypatch)
    chunked = run_subject(ref, sub, "F32")
    kq = [r for r in chunked.rows if r.tensor in ("kq", "kq_soft_max")]
    assert kq and all(r.local_passed and r.local["max_abs"] == 0.0 for r in kq)
    assert [(r.tensor, r.layer, r.local) for r in chunked.rows] == [(r.tensor, r.layer, r.local) for r in one.rows]
    subject = llorch_ref.load(long_tiny, weights="eager")
    B.wrong_attention_scale(monkeypatch, subject)
    bad = run_subject(ref, record_engine(subject, ids, n_greedy=0, score_rows=score_rows).to_dump(), "F32")
    fd = bad.first_divergence
    assert (fd["checkpoint"], fd["layer"]) == ("4", 0)
    row = next(r for r in bad.rows if r.tensor == "kq_soft_max" and r.layer == 0)
    assert row.local_passed is False                            # the local check sees the planted scale too
