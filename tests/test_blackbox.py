"""Black-box subjects (harness/blackbox.py, references/blackbox.py): a trace of tokens and log-probabilities against
the teacher-forced reference. The reference as its own black box passes with KLD 0; a planted error in the
log-probabilities, or in one weight matrix of the file a real engine runs, fails at a named step; bad input is one
`error:` line and exit 2."""
from __future__ import annotations

import numpy as np
import pytest

import llorch_ref
from llorch_ref.harness.blackbox import compare_trace, kld_step, log_softmax64
from llorch_ref.references.blackbox import Step, Trace

PROMPT = "Once upon a time, there was a little"


@pytest.fixture(scope="module")
def ref():
    return llorch_ref.load(threads=1)


def self_trace(eng, n=12, top_k=None) -> Trace:
    """The reference as a black box: its greedy tokens and its own log-probabilities (top_k, default all)."""
    ids = eng.tokenizer.encode(PROMPT)
    gen = list(eng.generate_ids(ids, max_tokens=n, ignore_eos=True))
    logp = log_softmax64(eng.logits(ids + gen[:-1])[len(ids) - 1:])
    steps = []
    for j, t in enumerate(gen):
        keep = np.argsort(-logp[j])[: top_k or logp.shape[1]]
        steps.append(Step(token=int(t), logprob=float(logp[j, t]), top={int(i): float(logp[j, i]) for i in keep}))
    return Trace(engine="self", version="", prompt=PROMPT, steps=steps, top_k=top_k or logp.shape[1],
                 whole=top_k is None, prompt_ids=ids, tokenized_by="the reference")


def test_the_reference_as_its_own_black_box_passes_with_kld_zero(ref):
    res = compare_trace(ref, self_trace(ref))
    v = res.verdict()
    assert v.status == "PASS", v.line()
    klds = [r.metrics["kld"] for r in res.rows if r.checkpoint == "11"]
    assert len(klds) == 12 and max(klds) < 1e-9
    assert all(r.metrics["kld_kind"] == "exact" and r.metrics["rank"] == 1 for r in res.rows if r.checkpoint == "11")
    assert v.required == ["cp0", "cp10", "cp11"]            # the black-box kind lacks every layer tensor


def test_top_k_gives_a_lower_bound_of_the_exact_kld(ref):
    tr, cut = self_trace(ref), self_trace(ref, top_k=20)
    rng = np.random.default_rng(0)
    for full, top in zip(tr.steps, cut.steps):      # the same noise on both: the bound stays under the exact figure
        noise = {i: v + 0.3 * rng.standard_normal() for i, v in full.top.items()}
        z = np.log(np.sum(np.exp(np.fromiter(noise.values(), float))))
        full.top = {i: v - z for i, v in noise.items()}
        top.top = {i: full.top[i] for i in top.top}
    logp = log_softmax64(ref.logits(tr.prompt_ids + [s.token for s in tr.steps[:-1]])[len(tr.prompt_ids) - 1:])
    for j in range(len(tr.steps)):
        exact, how, _ = kld_step(logp[j], tr.steps[j].top)
        bound, how_b, buckets = kld_step(logp[j], cut.steps[j].top)
        assert (how, how_b, buckets) == ("exact", "bound", 21)
        assert 0 <= bound <= exact + 1e-12 and exact > 1e-3


def test_a_planted_logprob_error_fails_at_its_step(ref):
    tr = self_trace(ref)
    s = tr.steps[5]
    tilted = {i: v + (3.0 if i % 2 else 0.0) for i, v in s.top.items()}       # half the vocabulary 20x likelier
    z = np.log(np.sum(np.exp(np.fromiter(tilted.values(), float))))
    s.top = {i: v - z for i, v in tilted.items()}
    v = compare_trace(ref, tr).verdict()
    assert v.status == "FAIL"
    assert (v.first_divergence["checkpoint"], v.first_divergence["step"]) == ("11", 5)


def test_a_flip_is_a_bug_unless_the_reference_has_a_near_tie(ref):
    tr = self_trace(ref)
    logp = log_softmax64(ref.logits(tr.prompt_ids + [s.token for s in tr.steps[:-1]])[len(tr.prompt_ids) - 1:])
    second = int(np.argsort(-logp[3])[1])
    tr.steps = tr.steps[:4]
    tr.steps[3].token = second                       # the engine chose the reference's second token at step 3
    margin = float(np.sort(logp[3])[-1] - np.sort(logp[3])[-2])
    wide = {"bands": {"exact:Q4_x": {"kld": 1.0, "near_tie": margin * 1.01}}}
    narrow = {"bands": {"exact:Q4_x": {"kld": 1.0, "near_tie": margin * 0.99}}}
    assert compare_trace(ref, tr, bands=wide).verdict().status == "PASS"
    fd = compare_trace(ref, tr, bands=narrow).verdict().first_divergence
    assert (fd["checkpoint"], fd["step"]) == ("10", 3)


def test_another_tokenization_fails_cp0_naming_the_token(ref):
    tr = self_trace(ref, n=3)
    tr.prompt_ids = tr.prompt_ids[:4] + [17] + tr.prompt_ids[5:]
    res = compare_trace(ref, tr)
    fd = res.verdict().first_divergence
    assert fd["checkpoint"] == "0"
    assert next(r for r in res.rows if r.checkpoint == "0").metrics["first_difference"] == 4
