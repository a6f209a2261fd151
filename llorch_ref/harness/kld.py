"""Corpus statistics of a subject's token distributions against a reference's, as llama-perplexity
--kl-divergence prints them (its names, its uncertainty formulas, its percentiles), in float64 and without its
16-bit storage of the base log-probabilities (llama.cpp keeps log p >= max - 16 of the base only).

    s = score_chunk(subject_logits, reference_logits, targets)     # per scored token, float64
    summary(list_of_scores) -> {"Mean PPL(Q)": (value, uncertainty), ..., "Same top p": ...}

Per scored token: nll = -log q(target), nll_base = -log p(target), KLD = sum_v p_v (log p_v - log q_v),
delta-p = q(target) - p(target), same top = argmax q == argmax p (p: reference, q: subject).

score_chunk runs on the array module the logits live on: CuPy when both sides are CuPy arrays (the [n, V]
logits stay on the device, only the per-position figures [n] come back), NumPy otherwise; the same float64
formulas either way.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

TOP_K = (1, 5, 10)
SCORE_BLOCK_BYTES = 32 << 20     # one block of rows, as float64, in score_chunk
DEVICE_BLOCK_BYTES = 256 << 20   # the same on a GPU (a few [rows, V] float64 temporaries of this size at once)


@dataclass
class ChunkScores:
    """One chunk's scored tokens (its second half, as llama-perplexity scores them)."""
    index: int
    nll: np.ndarray             # [n] float64: -log q(next token), the subject
    nll_base: np.ndarray        # [n] float64: -log p(next token), the reference
    kld: np.ndarray             # [n] float64
    p_diff: np.ndarray          # [n] float64
    same_top: np.ndarray        # [n] bool
    ref_top_in: dict            # k -> [n] bool: the reference's top token among the subject's top k

    def to_json(self) -> dict:
        return {"index": self.index, "nll": self.nll.tolist(), "nll_base": self.nll_base.tolist(),
                "kld": self.kld.tolist(), "p_diff": self.p_diff.tolist(), "same_top": self.same_top.tolist(),
                "ref_top_in": {str(k): v.tolist() for k, v in self.ref_top_in.items()}}

    @classmethod
    def from_json(cls, d: dict) -> "ChunkScores":
        a = lambda k: np.asarray(d[k], dtype=np.float64)
        return cls(int(d["index"]), a("nll"), a("nll_base"), a("kld"), a("p_diff"), np.asarray(d["same_top"], bool),
                   {int(k): np.asarray(v, bool) for k, v in d["ref_top_in"].items()})


def array_module(*arrays):
    """cupy when every one of arrays is a CuPy array, else numpy."""
    if arrays and all(type(a).__module__.split(".")[0] == "cupy" for a in arrays):
        import cupy
        return cupy
    return np


def to_host(a) -> np.ndarray:
    """A NumPy array of a (a CuPy array copied from the device)."""
    return a.get() if type(a).__module__.split(".")[0] == "cupy" else np.asarray(a)


def log_softmax64(logits, xp=np):
    x = xp.asarray(logits, dtype=xp.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - xp.log(xp.exp(x - m).sum(axis=-1, keepdims=True))


def score_chunk(index: int, subject_logits, reference_logits, targets, xp=None) -> ChunkScores:
    """subject_logits, reference_logits: [n, V] for the n scored positions; targets: [n] the next tokens. Scored
    a block of float64 rows at a time (SCORE_BLOCK_BYTES; DEVICE_BLOCK_BYTES on a GPU): every row's figures are
    its own, so the scores are those of all rows at once, with a working set of a few blocks instead of several
    [n, V] float64 arrays. xp: the array module (default array_module of the two sides: CuPy where both are on
    the device, the other side brought to the host otherwise); only the [n] figures are copied back."""
    xp = xp or array_module(subject_logits, reference_logits)
    if xp is np:
        q, p = to_host(subject_logits), to_host(reference_logits)
    else:
        q, p = xp.asarray(subject_logits), xp.asarray(reference_logits)
    if q.shape != p.shape:
        raise ValueError(f"subject logits {q.shape} and reference logits {p.shape} differ in shape")
    t = xp.asarray(to_host(targets).astype(np.int64))
    if q.ndim != 2 or t.shape != (q.shape[0],):
        raise ValueError(f"{t.shape[0] if t.ndim else 0} targets for logits of shape {q.shape}: one a row")
    block = SCORE_BLOCK_BYTES if xp is np else DEVICE_BLOCK_BYTES
    step = max(1, block // (8 * max(q.shape[-1], 1)))
    parts = [_score_rows(q[a:a + step], p[a:a + step], t[a:a + step], xp) for a in range(0, len(t), step)] or \
        [_score_rows(q, p, t, xp)]
    cat = lambda k: to_host(xp.concatenate([x[k] for x in parts]))
    return ChunkScores(index, cat("nll"), cat("nll_base"), cat("kld"), cat("p_diff"), cat("same_top"),
                       {k: to_host(xp.concatenate([x["top_in"][k] for x in parts])) for k in TOP_K})


def _score_rows(subject_logits, reference_logits, t, xp=np) -> dict:
    """score_chunk's figures for a block of rows, in the array module xp."""
    lq, lp = log_softmax64(subject_logits, xp), log_softmax64(reference_logits, xp)
    rows = xp.arange(len(t))
    nll, nll_base = -lq[rows, t], -lp[rows, t]
    kld = xp.sum(xp.exp(lp) * (lp - lq), axis=-1)
    ref_top = lp.argmax(-1)
    rank = _stable_rank(lq, ref_top, xp)
    return {"nll": nll, "nll_base": nll_base, "kld": kld, "p_diff": xp.exp(-nll) - xp.exp(-nll_base),
            "same_top": lq.argmax(-1) == ref_top, "top_in": {k: rank < k for k in TOP_K}}


def _stable_rank(values, index, xp=np):
    """The place of values[r, index[r]] in row r sorted descending, ties in index order (a stable sort of -values):
    the entries above it plus the equal ones before it. Two passes over the row instead of sorting it."""
    v = values[xp.arange(len(index)), index][:, None]
    before = xp.arange(values.shape[-1])[None, :] < index[:, None]
    return (values > v).sum(-1) + ((values == v) & before).sum(-1)


def _mean_unc(s, s2, n):
    """llama-perplexity's mean_and_uncertainty: the mean and the standard error (0 for 10 values or fewer)."""
    if n < 1:
        return 0.0, 0.0
    f = s / n
    df = s2 / n - f * f
    return f, (math.sqrt(df / (n - 1)) if df > 0 and n > 10 else 0.0)


def _percentile(sorted_values, fraction):
    """llama-perplexity's percentile: linear between the two nearest sorted values."""
    v = sorted_values
    if fraction <= 0:
        return float(v[0])
    if fraction >= 1:
        return float(v[-1])
    p = fraction * (len(v) - 1)
    i = int(p)
    p -= i
    return float((1 - p) * v[i] + p * v[min(i + 1, len(v) - 1)])


def _median(v):
    n = len(v)
    return float(0.5 * (v[n // 2] + v[n // 2 - 1])) if n % 2 == 0 else float(v[n // 2])


KLD_PERCENTILES = [("Maximum", 1.0), ("99.9%", 0.999), ("99.0%", 0.99), ("95.0%", 0.95), ("90.0%", 0.9),
                   ("Median", None), ("10.0%", 0.1), ("5.0%", 0.05), ("1.0%", 0.01), ("0.1%", 0.001), ("Minimum", 0.0)]
DP_PERCENTILES = [("Maximum", 1.0), ("99.9%", 0.999), ("99.0%", 0.99), ("95.0%", 0.95), ("90.0%", 0.9),
                  ("75.0%", 0.75), ("Median", None), ("25.0%", 0.25), ("10.0%", 0.1), ("5.0%", 0.05), ("1.0%", 0.01),
                  ("0.1%", 0.001), ("Minimum", 0.0)]


def summary(scores: list[ChunkScores]) -> dict:
    """The statistics over every scored token, under llama-perplexity's names: (value, uncertainty) pairs where
    it prints one, plain values elsewhere; Δp figures as fractions (llama-perplexity prints percent)."""
    cat = lambda f: np.concatenate([getattr(s, f) for s in scores]) if scores else np.zeros(0)
    nll, nllb, kld, dp = cat("nll"), cat("nll_base"), cat("kld"), cat("p_diff")
    n = len(nll)
    if n < 2:
        raise ValueError(f"{n} scored token(s): too few for statistics")
    lp, lpb = _mean_unc(nll.sum(), (nll ** 2).sum(), n), _mean_unc(nllb.sum(), (nllb ** 2).sum(), n)
    cov = ((nll * nllb).sum() / n - (nll.sum() / n) * (nllb.sum() / n)) / (n - 1) if n >= 10 else 0.0
    ppl, pplb = math.exp(lp[0]), math.exp(lpb[0])
    ratio = lp[0] - lpb[0]
    ratio_unc = math.sqrt(max(lp[1] ** 2 + lpb[1] ** 2 - 2 * cov, 0.0))
    ppl_unc, pplb_unc = ppl * lp[1], pplb * lpb[1]
    out = {"scored tokens": n, "chunks": len(scores),
           "Mean PPL(Q)": (ppl, ppl_unc), "Mean PPL(base)": (pplb, pplb_unc),
           "Cor(ln(PPL(Q)), ln(PPL(base)))": cov / (lp[1] * lpb[1]) if lp[1] * lpb[1] > 0 else float("nan"),
           "Mean ln(PPL(Q)/PPL(base))": (ratio, ratio_unc),
           "Mean PPL(Q)/PPL(base)": (math.exp(ratio), math.exp(ratio) * ratio_unc),
           "Mean PPL(Q)-PPL(base)": (ppl - pplb, math.sqrt(max(ppl_unc ** 2 + pplb_unc ** 2 - 2 * ppl * pplb * cov, 0.0))),
           "Mean KLD": _mean_unc(kld.sum(), (kld ** 2).sum(), n)}
    ks, ds = np.sort(kld), np.sort(dp)
    for name, f in KLD_PERCENTILES:
        out[f"{name} KLD"] = _median(ks) if f is None else _percentile(ks, f)
    out["Mean Δp"] = _mean_unc(dp.sum(), (dp ** 2).sum(), n)
    for name, f in DP_PERCENTILES:
        out[f"{name} Δp"] = _median(ds) if f is None else _percentile(ds, f)
    mse = _mean_unc((dp ** 2).sum(), (dp ** 4).sum(), n)
    rms = math.sqrt(mse[0])
    out["RMS Δp"] = (rms, 0.5 / rms * mse[1] if rms > 0 else 0.0)
    same = float(cat("same_top").mean())
    out["Same top p"] = (same, math.sqrt(same * (1 - same) / (n - 1)))
    for k in TOP_K[1:]:
        out[f"Reference top in subject top {k}"] = float(np.concatenate([s.ref_top_in[k] for s in scores]).mean())
    return out


def kld_by_position(scores: list[ChunkScores]) -> list[float]:
    """Mean KLD at each scored position of a chunk (position first + i predicts token first + i + 1)."""
    return np.mean(np.stack([s.kld for s in scores]), axis=0).tolist()
