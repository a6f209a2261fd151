"""Token selection as a chain of small pure functions over one row of logits.

Order (documented, fixed): repetition/presence/frequency penalties -> temperature -> top-k -> top-p
-> min-p -> draw from a seeded numpy.random.Generator. Temperature 0 means greedy (argmax after the
penalties). Filters remove tokens by setting their logit to -inf; probabilities are float64.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields

import numpy as np

from ..errors import ParameterError, SamplingError

_F32_MAX = np.finfo(np.float32).max


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0          # 0: greedy
    top_k: int = 0                    # 0: off; else keep the k highest logits (ties at the k-th kept)
    top_p: float = 1.0                # 1: off; else the smallest set whose probability reaches top_p
    min_p: float = 0.0                # 0: off; else drop tokens with p < min_p * p_max
    repetition_penalty: float = 1.0   # 1: off; logit/penalty if > 0 else logit*penalty, for recent tokens
    presence_penalty: float = 0.0     # subtracted once from every recent token's logit
    frequency_penalty: float = 0.0    # subtracted per occurrence of a recent token
    penalty_last_n: int = 64          # how many recent tokens the penalties look at (-1: all)
    seed: int | None = None           # None: a fresh seed is drawn and reported

    def errors(self) -> dict:
        """-> {field: message} for every invalid field (empty when valid)."""
        e = {}

        def num(name, lo=None, hi=None, lo_open=False, hi_open=False, integer=False):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and not isinstance(v, int)):
                e[name] = f"must be {'an integer' if integer else 'a number'}, got {v!r}"
                return
            if not math.isfinite(v):
                e[name] = f"must be finite, got {v!r}"
            elif lo is not None and (v < lo or (lo_open and v == lo)):
                e[name] = f"must be {'>' if lo_open else '>='} {lo}, got {v!r}"
            elif hi is not None and (v > hi or (hi_open and v == hi)):
                e[name] = f"must be {'<' if hi_open else '<='} {hi}, got {v!r}"

        num("temperature", 0, 100)
        num("top_k", 0, integer=True)
        num("top_p", 0, 1, lo_open=True)
        num("min_p", 0, 1, hi_open=True)
        num("repetition_penalty", 0, 100, lo_open=True)
        num("presence_penalty", -100, 100)
        num("frequency_penalty", -100, 100)
        num("penalty_last_n", -1, integer=True)
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not 0 <= self.seed < 2 ** 64):
            e["seed"] = f"must be an integer in 0..2^64-1 or null, got {self.seed!r}"
        return e

    def validate(self) -> "SamplingParams":
        errs = self.errors()
        if errs:
            raise ParameterError("; ".join(f"{k}: {v}" for k, v in errs.items()))
        return self

    @classmethod
    def from_kwargs(cls, **kw) -> "SamplingParams":
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(kw) - names)
        if unknown:
            raise ParameterError(f"unknown sampling parameter(s): {', '.join(unknown)} "
                                 f"(known: {', '.join(sorted(names))})")
        return cls(**kw).validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Whether any repetition, presence or frequency penalty applies (apply_penalties changes the logits)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


# -- the filters: logits [V] float32 -> logits [V] float32 (removed tokens at -inf) ---------------------
def apply_penalties(logits, history, repetition=1.0, presence=0.0, frequency=0.0, last_n=64):
    """Penalize tokens that occur in the last `last_n` ids of `history` (llama.cpp's penalties sampler)."""
    if repetition == 1.0 and presence == 0.0 and frequency == 0.0:
        return logits
    recent = list(history) if last_n < 0 else list(history)[-last_n:] if last_n > 0 else []
    if not recent:
        return logits
    ids, counts = np.unique(np.asarray(recent, dtype=np.int64), return_counts=True)
    out = logits.copy()
    x = out[ids]
    with np.errstate(over="ignore", under="ignore", divide="ignore", invalid="ignore"):
        x = np.where(x > 0, x / np.float32(repetition), x * np.float32(repetition)).astype(np.float32)
        x = x - counts.astype(np.float32) * np.float32(frequency) - np.float32(presence)
    # a tiny repetition penalty scales a logit past float32's range: saturate, never inf (inf - inf = NaN later)
    out[ids] = np.clip(x, -_F32_MAX, _F32_MAX)
    return out


def apply_temperature(logits, temperature):
    """logits / temperature in float32; where that overflows (a tiny temperature), the same distribution
    from (logits - max) / temperature in float64: the top logit at 0, the others at -inf when far below."""
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        y = (logits / np.float32(temperature)).astype(np.float32)
    if np.isfinite(y[np.isfinite(logits)]).all():
        return y
    x = np.asarray(logits, dtype=np.float64)
    finite = np.isfinite(x)
    top = x[finite].max() if finite.any() else 0.0
    with np.errstate(over="ignore", under="ignore"):
        return ((x - top) / temperature).astype(np.float32)


def top_k(logits, k):
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = np.partition(logits, -k)[-k]
    return np.where(logits >= kth, logits, np.float32(-np.inf)).astype(np.float32)


def top_p(logits, p):
    """Keep the highest-probability tokens until their total reaches p (the token crossing p is kept)."""
    if p >= 1.0:
        return logits
    order = np.argsort(-logits, kind="stable")
    probs = softmax(logits[order])
    keep_n = int(np.searchsorted(np.cumsum(probs), p) + 1)
    out = np.full_like(logits, -np.inf)
    kept = order[:max(keep_n, 1)]
    out[kept] = logits[kept]
    return out


def min_p(logits, m):
    if m <= 0.0:
        return logits
    finite = np.isfinite(logits)
    lmax = logits[finite].max()
    keep = finite & (np.exp(logits.astype(np.float64) - lmax) >= m)
    return np.where(keep, logits, np.float32(-np.inf)).astype(np.float32)


def softmax(logits, axis=-1):
    """logits: [..., V] float32 -> probabilities [..., V] float64 (max-subtracted, normalized in float64)."""
    x = np.asarray(logits, dtype=np.float64)
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def greedy(logits) -> int:
    """logits: [V] -> the token with the highest logit (lowest id on exact ties, like np.argmax)."""
    return int(np.argmax(logits))


def filtered_logits(logits, params: SamplingParams, history=()):
    """The chain up to (not including) the draw -> logits with removed tokens at -inf."""
    x = apply_penalties(np.asarray(logits, dtype=np.float32), history, params.repetition_penalty,
                        params.presence_penalty, params.frequency_penalty, params.penalty_last_n)
    if params.greedy:
        return x
    x = apply_temperature(x, params.temperature)
    x = top_k(x, params.top_k)
    x = top_p(x, params.top_p)
    return min_p(x, params.min_p)


def draw(logits, rng: np.random.Generator) -> int:
    """Inverse-CDF draw from softmax(logits) with one uniform number from rng."""
    probs = softmax(logits)
    cdf = np.cumsum(probs)
    if not (np.isfinite(cdf[-1]) and cdf[-1] > 0):      # never a token drawn from NaN probabilities
        raise SamplingError("the filtered distribution is not finite (NaN or no token left); this is a bug in "
                            "the sampler: please report the sampling parameters")
    return int(min(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"), len(cdf) - 1))


class Sampler:
    """Per-request state: the parameters, the seeded generator and the token history for penalties."""

    def __init__(self, params: SamplingParams, history=()):
        self.params = params.validate()
        self.seed = params.seed if params.seed is not None else int(np.random.SeedSequence().entropy % 2 ** 63)
        self.rng = np.random.default_rng(self.seed)
        self.history = list(history)

    def __call__(self, logits) -> int:
        x = filtered_logits(logits, self.params, self.history)
        return self.took(greedy(x) if self.params.greedy else draw(x, self.rng))

    @property
    def plain_greedy(self) -> bool:
        """Greedy without penalties: the argmax of the raw logits, taken wherever they are."""
        return self.params.greedy and not self.params.penalized

    def took(self, tok: int) -> int:
        """A token chosen elsewhere (a GPU's chained greedy steps) -> the same token, added to the history."""
        self.history.append(tok)
        return tok

    def next(self, logits, backend) -> int:
        """logits: [V] on `backend` -> the next token. Plain greedy (no penalty) is the argmax of the raw logits,
        taken where they are (a GPU sends back one index, not the row); anything else samples on the host."""
        if self.plain_greedy:
            return self.took(backend.argmax(logits))
        return self(backend.to_numpy(logits))
