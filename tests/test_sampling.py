"""Sampling filters against llama.cpp's sampler chain (an independent implementation), the draw against
its distribution, and reproducibility per seed."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

from llorch_ref.errors import ParameterError
from llorch_ref.generate import sampling as S

N_VECTORS = 1000
V = 256


def llama_apply(llamacpp, smpl, logits, history=()):
    """Run one llama.cpp sampler over logits -> {token id: logit} of the candidates it keeps."""
    arr = (llamacpp.llama_token_data * len(logits))()
    for i, l in enumerate(logits):
        arr[i].id, arr[i].logit, arr[i].p = i, float(l), 0.0
    cur = llamacpp.llama_token_data_array(arr, len(logits), -1, False)
    for t in history:
        llamacpp.llama_sampler_accept(smpl, int(t))
    llamacpp.llama_sampler_apply(smpl, ctypes.byref(cur))
    kept = {}
    for i in range(cur.size):
        if np.isfinite(cur.data[i].logit):
            kept[cur.data[i].id] = cur.data[i].logit
    llamacpp.llama_sampler_free(smpl)
    return kept


def ours_kept(x):
    return {i: float(v) for i, v in enumerate(x) if np.isfinite(v)}


def random_logits(rng):
    return (rng.standard_normal(V) * rng.uniform(0.5, 5.0)).astype(np.float32)


@pytest.mark.parametrize("name", ["top_k", "top_p", "min_p", "temperature", "penalties"])
def test_filter_agrees_with_llamacpp(llamacpp, name):
    rng = np.random.default_rng(1234)
    mismatches = 0
    for _ in range(N_VECTORS):
        x = random_logits(rng)
        if name == "top_k":
            k = int(rng.integers(1, 60))
            ours, ref = S.top_k(x, k), llama_apply(llamacpp, llamacpp.llama_sampler_init_top_k(k), x)
        elif name == "top_p":
            p = float(rng.uniform(0.05, 0.99))
            ours, ref = S.top_p(x, p), llama_apply(llamacpp, llamacpp.llama_sampler_init_top_p(p, 1), x)
        elif name == "min_p":
            m = float(rng.uniform(0.01, 0.5))
            ours, ref = S.min_p(x, m), llama_apply(llamacpp, llamacpp.llama_sampler_init_min_p(m, 1), x)
        elif name == "temperature":
            t = float(rng.uniform(0.1, 3.0))
            ours, ref = S.apply_temperature(x, t), llama_apply(llamacpp, llamacpp.llama_sampler_init_temp(t), x)
        else:
            hist = rng.integers(0, V, size=int(rng.integers(1, 100))).tolist()
            rep, freq, pres = float(rng.uniform(1.0, 2.0)), float(rng.uniform(0, 1)), float(rng.uniform(0, 1))
            last_n = int(rng.integers(1, 80))
            ours = S.apply_penalties(x, hist, rep, pres, freq, last_n)
            ref = llama_apply(llamacpp, llamacpp.llama_sampler_init_penalties(V, last_n, rep, freq, pres), x, hist)
        o = ours_kept(ours)
        if set(o) != set(ref) or any(not np.isclose(o[i], ref[i], rtol=1e-6, atol=1e-6) for i in o):
            mismatches += 1
    print(f"{name}: {N_VECTORS - mismatches}/{N_VECTORS} random logit vectors agree with llama.cpp")
    assert mismatches == 0


def test_draw_follows_the_filtered_distribution():
    rng = np.random.default_rng(7)
    x = S.top_k(random_logits(rng), 12)
    probs = S.softmax(x)
    n = 40000
    draws = np.bincount([S.draw(x, rng) for _ in range(n)], minlength=V)
    support = probs > 0
    assert draws[~support].sum() == 0                      # nothing outside the filtered set
    expected = probs[support] * n
    chi2 = float((((draws[support] - expected) ** 2) / expected).sum())
    dof = int(support.sum()) - 1
    print(f"chi2 {chi2:.1f} with {dof} degrees of freedom")
    assert chi2 < dof + 6 * np.sqrt(2 * dof)              # ~4 sigma for chi2


def test_same_seed_same_tokens_and_different_seed_differs():
    rng = np.random.default_rng(3)
    rows = [random_logits(rng) for _ in range(50)]
    params = S.SamplingParams(temperature=1.0, top_p=0.95, seed=42)

    def run(p):
        s = S.Sampler(p)
        return [s(r) for r in rows]
    assert run(params) == run(params)
    assert run(params) != run(S.SamplingParams(temperature=1.0, top_p=0.95, seed=43))


def test_temperature_zero_is_greedy_after_penalties():
    x = np.array([1.0, 3.0, 2.9], np.float32)
    assert S.Sampler(S.SamplingParams())(x) == 1
    s = S.Sampler(S.SamplingParams(repetition_penalty=1.5), history=[1])
    assert s(x) == 2                                       # 3.0 / 1.5 = 2.0 < 2.9


@pytest.mark.parametrize("kw, field", [
    (dict(temperature=-1), "temperature"), (dict(top_k=-3), "top_k"), (dict(top_k=2.5), "top_k"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(min_p=1.0), "min_p"),
    (dict(repetition_penalty=0), "repetition_penalty"), (dict(seed=-1), "seed"),
    (dict(temperature=float("nan")), "temperature"),
])
def test_invalid_parameters_are_rejected_with_the_field(kw, field):
    with pytest.raises(ParameterError, match=field):
        S.SamplingParams.from_kwargs(**kw)


def test_unknown_parameter_is_rejected():
    with pytest.raises(ParameterError, match="unknown sampling parameter"):
        S.SamplingParams.from_kwargs(temprature=0.5)


# -- every value validation accepts is numerically safe (a temperature of 1e-38 must not give NaN probabilities
#    and the last token id every time) ------------------------------------------------------------------
TINY = [1e-38, 1e-45, 1e-300, 5e-324]


@pytest.mark.parametrize("temperature", TINY)
def test_tiny_temperature_is_greedy_not_nan(temperature):
    rng = np.random.default_rng(3)
    for trial in range(20):
        logits = random_logits(rng)
        top = int(np.argmax(logits))
        assert S.SamplingParams(temperature=temperature).errors() == {}
        x = S.filtered_logits(logits, S.SamplingParams(temperature=temperature))
        p = S.softmax(x)
        assert np.isfinite(p).all() and abs(p.sum() - 1) < 1e-12
        assert p[top] >= 0.5                                    # all the mass on the top logit (ties share)
        smp = S.Sampler(S.SamplingParams(temperature=temperature, seed=trial))
        assert smp(logits) == top


@pytest.mark.parametrize("penalty", TINY + [100.0])
def test_extreme_repetition_penalty_stays_finite(penalty):
    """A penalty below 1 is a bonus: a tiny one lifts every recent token with a positive logit to the top
    (saturated at float32's largest value, never inf); 100 pushes them down. Never NaN."""
    rng = np.random.default_rng(4)
    for trial in range(20):
        logits = random_logits(rng)
        history = [int(i) for i in rng.choice(V, 8, replace=False)]
        for temperature in (0.0, 0.7, 1e-38):
            params = S.SamplingParams(temperature=temperature, repetition_penalty=penalty, seed=trial)
            x = S.filtered_logits(logits, params, history)
            assert not np.isnan(x).any()
            tok = S.Sampler(params, history=history)(logits)
            assert 0 <= tok < V
            lifted = [t for t in history if logits[t] > 0]
            if penalty < 1e-30 and lifted:
                assert tok in lifted


def test_plain_greedy_takes_the_backend_argmax_and_penalties_the_host_path():
    """Sampler.next: plain greedy asks the backend for its argmax (a GPU sends back one index); with a penalty
    the host chain runs, and both answer as Sampler() on the host row does."""
    class Counting:
        def __init__(self):
            self.argmaxes = 0

        def to_numpy(self, x):
            return np.asarray(x)

        def argmax(self, x):
            self.argmaxes += 1
            return int(np.argmax(x))

    rng = np.random.default_rng(3)
    logits = rng.standard_normal(50).astype(np.float32)
    logits[[7, 30]] = logits.max() + 1                      # a tie: the first wins
    be = Counting()
    s = S.Sampler(S.SamplingParams())
    assert s.next(logits, be) == S.Sampler(S.SamplingParams())(logits) == 7 and be.argmaxes == 1
    pen = S.SamplingParams(repetition_penalty=2.0)
    s = S.Sampler(pen, history=[7])
    assert s.next(logits, be) == S.Sampler(pen, history=[7])(logits) == 30 and be.argmaxes == 1
    assert s.history == [7, 30]
