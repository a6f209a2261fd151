"""harness/kld.score_chunk on the array module the logits live on: on NumPy bit for bit the scores of a plain
all-rows-at-once computation (float64 log-softmax, the stable rank of an argsort); through a device-like module
only the [n] figures cross back to the host; a planted bug (float32 log-softmax, a target one token off) breaks
the equality; eval_chunk scores the rows that predict tokens[first + 1:]. On a GPU (CuPy): the same figures as
NumPy to 1e-12 and the same ties."""
from __future__ import annotations

import types

import numpy as np
import pytest

from llorch_ref.harness import corpus_eval, kld


def plain_scores(q, p, t) -> dict:
    """llama-perplexity's per-token figures over all rows at once, in float64; top k from a stable argsort."""
    def lsm(x):
        x = np.asarray(x, dtype=np.float64)
        m = x.max(axis=-1, keepdims=True)
        return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))
    lq, lp = lsm(q), lsm(p)
    r, t = np.arange(len(t)), np.asarray(t, dtype=np.int64)
    nll, nll_base = -lq[r, t], -lp[r, t]
    ref_top = lp.argmax(-1)
    order = np.argsort(-lq, axis=-1, kind="stable")
    return {"nll": nll, "nll_base": nll_base, "kld": np.sum(np.exp(lp) * (lp - lq), axis=-1),
            "p_diff": np.exp(-nll) - np.exp(-nll_base), "same_top": lq.argmax(-1) == ref_top,
            "ref_top_in": {k: (order[:, :k] == ref_top[:, None]).any(-1) for k in kld.TOP_K}}


def bit_equal(s: kld.ChunkScores, want: dict) -> bool:
    return (all(np.array_equal(getattr(s, f), want[f]) and getattr(s, f).dtype == want[f].dtype
                for f in ("nll", "nll_base", "kld", "p_diff", "same_top"))
            and all(np.array_equal(s.ref_top_in[k], want["ref_top_in"][k]) for k in kld.TOP_K))


def logits_with_ties(seed=0, n=300, v=700):
    """float32 logits as engines hand them; the subject's rows hold runs of equal values (ties for the rank)."""
    rng = np.random.default_rng(seed)
    p = rng.normal(size=(n, v)).astype(np.float32)
    q = (p + rng.normal(scale=0.2, size=(n, v))).astype(np.float32)
    q[::3] = np.round(q[::3])                                # whole numbers: many equal values in a row
    q[1::7, :40] = q[1::7, :1]                               # the first 40 tokens tied with token 0
    return q, p, rng.integers(0, v, n)


@pytest.mark.parametrize("block", [8 * 700 * 7, 1 << 40])    # blocks of 7 rows, one block
def test_numpy_scores_are_those_of_all_rows_at_once_bit_for_bit(monkeypatch, block):
    monkeypatch.setattr(kld, "SCORE_BLOCK_BYTES", block)
    q, p, t = logits_with_ties()
    s = kld.score_chunk(4, q, p, t)
    assert s.index == 4 and bit_equal(s, plain_scores(q, p, t))
    assert s.same_top.any() and not s.same_top.all() and not s.ref_top_in[5].all()


def test_a_float32_log_softmax_fails_the_equality(monkeypatch):
    q, p, t = logits_with_ties(1)
    want = plain_scores(q, p, t)
    lsm64 = kld.log_softmax64

    def lsm32(x, xp=np):
        x = xp.asarray(x, dtype=xp.float32)
        return lsm64(x - x.max(axis=-1, keepdims=True), xp).astype(xp.float32).astype(xp.float64)
    monkeypatch.setattr(kld, "log_softmax64", lsm32)
    assert not bit_equal(kld.score_chunk(0, q, p, t), want)


def test_a_target_one_token_off_fails_the_equality():
    q, p, t = logits_with_ties(2)
    assert not bit_equal(kld.score_chunk(0, q, p, np.roll(t, 1)), plain_scores(q, p, t))


def test_targets_that_do_not_match_the_rows_are_refused():
    q, p, t = logits_with_ties(3, n=20, v=50)
    with pytest.raises(ValueError, match="one a row"):
        kld.score_chunk(0, q, p, t[:-1])


class DeviceArray(np.ndarray):
    """An array 'on a device': kld.to_host fetches it with .get(), as CuPy's; each fetch is recorded."""
    __module__ = "cupy._stand_in"
    fetched: list = []

    def get(self):
        DeviceArray.fetched.append(self.shape)
        return np.asarray(self).view(np.ndarray).copy()


def device_module():
    """NumPy's functions, every array they make a DeviceArray: the module score_chunk runs on for a device."""
    on = lambda a: np.asarray(a).view(DeviceArray)
    return types.SimpleNamespace(
        asarray=lambda a, dtype=None: on(np.asarray(a.view(np.ndarray) if isinstance(a, DeviceArray) else a,
                                                    dtype=dtype)),
        float64=np.float64, float32=np.float32, log=np.log, exp=np.exp, sum=np.sum,
        arange=lambda *a: on(np.arange(*a)), concatenate=lambda xs: on(np.concatenate(xs)))


@pytest.mark.parametrize("block", [8 * 700 * 7, 1 << 40])
def test_on_a_device_only_the_per_position_figures_come_back(monkeypatch, block):
    monkeypatch.setattr(kld, "DEVICE_BLOCK_BYTES", block)
    q, p, t = logits_with_ties(4)
    DeviceArray.fetched = []
    s = kld.score_chunk(0, q.view(DeviceArray), p.view(DeviceArray), t, xp=device_module())
    assert bit_equal(s, plain_scores(q, p, t))
    assert all(type(getattr(s, f)) is np.ndarray for f in ("nll", "kld", "same_top"))
    assert DeviceArray.fetched == [(len(t),)] * (5 + len(kld.TOP_K))      # 5 figures and 3 top-k flags, [n] each


def test_the_array_module_is_cupy_only_where_both_sides_are_on_the_device():
    q = np.zeros((2, 3), np.float32)
    assert kld.array_module(q, q) is np and kld.array_module(q, q.view(DeviceArray)) is np
    assert kld.array_module(q.view(DeviceArray), q) is np


class Rows:
    """A logit source whose row i of a chunk is fixed by (tokens, position first + i)."""

    def __init__(self, seed, v=64):
        self.seed, self.v = seed, v

    def logits(self, tokens, first):
        rng = np.random.default_rng([self.seed, len(tokens), first])
        return rng.normal(size=(len(tokens) - 1 - first, self.v)).astype(np.float32)


def test_eval_chunk_scores_the_rows_that_predict_the_next_tokens():
    tokens = list(np.random.default_rng(5).integers(0, 64, 48))
    sub, ref = Rows(1), Rows(2)
    s = corpus_eval.eval_chunk(3, tokens, sub, ref)
    first = len(tokens) // 2
    q, p = sub.logits(tokens, first), ref.logits(tokens, first)
    assert q.shape[0] == 23 and bit_equal(s, plain_scores(q, p, tokens[first + 1:]))
    assert not bit_equal(s, plain_scores(q, p, tokens[first:-1]))        # one token early: other figures


def test_eval_chunk_adds_each_part_to_the_clock():
    tokens, clock = list(range(40)), {"scoring_s": 1.0}
    corpus_eval.eval_chunk(0, tokens, Rows(1), Rows(2), clock)
    assert sorted(clock) == ["reference_s", "scoring_s", "subject_s"]
    assert clock["scoring_s"] > 1.0 and clock["subject_s"] > 0 and clock["reference_s"] > 0


def _cupy():
    try:
        import cupy as cp
        cp.zeros(1)
        return cp
    except Exception:                                     # not installed, or no device
        return None


@pytest.mark.skipif(_cupy() is None, reason="needs CuPy and a GPU")
def test_on_cupy_the_figures_are_numpys_and_the_ties_the_same():
    cp = _cupy()
    q, p, t = logits_with_ties(6)
    host = kld.score_chunk(0, q, p, t)
    dev = kld.score_chunk(0, cp.asarray(q), cp.asarray(p), t)
    for f in ("nll", "nll_base", "kld", "p_diff"):
        np.testing.assert_allclose(getattr(dev, f), getattr(host, f), rtol=1e-12, atol=1e-14)
    assert np.array_equal(dev.same_top, host.same_top)
    assert all(np.array_equal(dev.ref_top_in[k], host.ref_top_in[k]) for k in kld.TOP_K)
    mixed = corpus_eval.eval_chunk(0, list(range(40)), Rows(1), _OnDevice(Rows(2), cp))
    both = corpus_eval.eval_chunk(0, list(range(40)), Rows(1), Rows(2))
    np.testing.assert_allclose(mixed.kld, both.kld, rtol=1e-12, atol=1e-14)


class _OnDevice:
    def __init__(self, src, cp):
        self.src, self.cp = src, cp

    def logits(self, tokens, first):
        return self.src.logits(tokens, first)

    def device_logits(self, tokens, first):
        return self.cp.asarray(self.src.logits(tokens, first))


def stand_in_cupy():
    """A module named cupy over device_module(): what array_module finds where CuPy arrays are given."""
    m = device_module()
    m.synced = []
    m.cuda = types.SimpleNamespace(get_current_stream=lambda: types.SimpleNamespace(
        synchronize=lambda: m.synced.append(1)))
    return m


def test_a_host_side_goes_to_the_device_of_the_other_and_only_figures_come_back(monkeypatch):
    import sys
    fake = stand_in_cupy()
    monkeypatch.setitem(sys.modules, "cupy", fake)
    tokens, clock = list(np.random.default_rng(7).integers(0, 64, 48)), {}
    DeviceArray.fetched = []
    s = corpus_eval.eval_chunk(0, tokens, Rows(1), _OnDevice(Rows(2), fake), clock)
    first = len(tokens) // 2
    want = plain_scores(Rows(1).logits(tokens, first), Rows(2).logits(tokens, first), tokens[first + 1:])
    assert bit_equal(s, want)
    assert DeviceArray.fetched == [(23,)] * (5 + len(kld.TOP_K)) and fake.synced == [1]   # the device side waited for


def test_equal_specs_share_one_source_and_both_sides_still_run(monkeypatch):
    from llorch_ref.references.logit_sources import SourceSpec
    built, calls = [], []

    class Counting(Rows):
        def logits(self, tokens, first):
            calls.append(first)
            return super().logits(tokens, first)

    def build(spec, ctx):
        built.append(spec)
        return Counting(len(built))
    monkeypatch.setattr(SourceSpec, "build", build)
    chunks = [list(range(i, i + 32)) for i in (0, 30)]
    same = corpus_eval.run_eval(SourceSpec("cupy", "m.gguf"), SourceSpec("cupy", "m.gguf"), chunks, "t")
    assert len(built) == 1 and len(calls) == 4 and all((c.kld == 0).all() for c in same.scores)
    corpus_eval.run_eval(SourceSpec("cupy", "m.gguf"), SourceSpec("cupy", "n.gguf"), chunks, "t")
    assert len(built) == 3
