"""A black-box engine's greedy run (references/blackbox.py: Trace) against the reference, teacher-forced: the
reference runs one forward over the prompt and the engine's own tokens, and every step the engine reported is
compared with the reference's distribution at the same position.

Rows of the DiffResult, so that harness/verdict.py judges it as every other comparison:
- checkpoint 0: the prompt's tokenization (the engine's tokenize route), else the round trip of its tokens
  (their bytes give the text it returned);
- checkpoint 11, one row per step: KL(reference || engine) in nats, exact where the engine gave the whole
  vocabulary, else a lower bound: the engine's top K ids as buckets and the rest of the vocabulary (with the ids
  whose text is shared) lumped into one tail bucket on both sides (merging buckets never raises a KLD); the
  reference's log-probability and rank of the engine's token;
- checkpoint 10, one row per step: the engine's token is the reference's argmax, or the reference's top-2 margin
  is inside the near-tie band (a legitimate flip is not a bug).
- checkpoint 11, one row for the run ("logprobs@run", at its last step): over every step, the mean KLD and the mean
  shift of the engine's log-probability of its own token from the reference's (signed: engine - reference). A
  planted error a few percent large hides under the per-step band (set by the worst clean step) but moves these
  means, which are steadier than any one step. Judged where the run has at least the band's `min_steps` steps.
Step 0 is the distribution after the prompt (the prompt's forward); step K the one after the engine's K-th token.
Bands per arithmetic (the run's per subject kind too): checkpoints/blackbox_bands.json.
"""
from __future__ import annotations

import json
import time

import numpy as np

from ..checkpoints import catalogue_path, engine_band_class, load_specs
from ..errors import BlackBoxError, HarnessError
from ..references.llorch import engine_label
from .metrics import within
from .result import DiffResult, Row

KIND = "blackbox"          # the engine kind of checkpoints/coverage.json: no layer tensor, no logits


def load_bands() -> dict:
    """The black-box bands (checkpoints/blackbox_bands.json): arithmetic key -> {"kld", "near_tie"}."""
    return json.loads((catalogue_path() / "blackbox_bands.json").read_text())


def band_key(engine) -> str:
    """The band a reference engine is judged under: 'ggml' (llama.cpp's arithmetic reproduced) or
    'exact:<weight class>' (float32 on the dequantized weights)."""
    return "ggml" if engine.numerics == "ggml" else f"exact:{engine_band_class(engine)}"


def band_for(engine, bands: dict | None = None) -> tuple[str, dict]:
    """-> (key, {"kld", "near_tie"}) for this reference engine; a key with no measured band is refused."""
    key = band_key(engine)
    table = (bands or load_bands())["bands"]
    if key not in table:
        raise HarnessError(f"no black-box band for {key!r} in blackbox_bands.json (measured: {', '.join(table)}); "
                           f"measure one with tools/blackbox_figures.py calibrate")
    return key, {k: v for k, v in table[key].items() if not k.startswith("_")}


RUN = "logprobs@run"      # the tensor name of the run-level row


def run_band_for(band: dict, subject_kind: str) -> dict | None:
    """The run-level band {"mean_kld", "logprob_shift", "min_steps"} of a subject kind ('openai', 'mistral.rs')
    under an arithmetic's band; a kind with none measured gets the widest measured (None where none is)."""
    runs = band.get("run") or {}
    if subject_kind in runs:
        return dict(runs[subject_kind])
    if not runs:
        return None
    return {k: max(r[k] for r in runs.values()) for k in ("mean_kld", "logprob_shift", "min_steps")}


def run_statistics(klds, ref_logprobs, engine_logprobs) -> dict:
    """The run-level figures of per-step lists: mean KLD, the mean signed shift engine - reference of the engine's
    token's log-probability and its size (what the band bounds), the step count."""
    k = np.asarray(klds, dtype=np.float64)
    d = np.asarray(engine_logprobs, dtype=np.float64) - np.asarray(ref_logprobs, dtype=np.float64)
    shift = float(d.mean()) if d.size else 0.0
    return {"mean_kld": float(k.mean()) if k.size else 0.0, "mean_shift": shift, "logprob_shift": abs(shift),
            "steps": int(k.size)}


def log_softmax64(logits) -> np.ndarray:
    """log softmax of each row, in float64."""
    x = np.asarray(logits, dtype=np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def _xlogy(p: np.ndarray, q: np.ndarray) -> float:
    """sum p log(p/q), with 0 log 0 = 0 and q floored at 1e-300."""
    m = p > 0
    return float(np.sum(p[m] * (np.log(p[m]) - np.log(np.maximum(q[m], 1e-300)))))


def kld_step(ref_logp: np.ndarray, top: dict) -> tuple[float, str, int]:
    """KL(reference || engine) at one step -> (nats, 'exact' | 'bound', buckets). The buckets are the ids the engine
    gave; the rest of the vocabulary is one tail bucket on both sides (its mass: 1 - the listed mass, at least
    0). With every id listed it is the exact KLD; with fewer it is a lower bound of it (merging buckets never
    raises a KLD)."""
    ids = np.fromiter(top.keys(), dtype=np.int64, count=len(top))
    q = np.exp(np.fromiter(top.values(), dtype=np.float64, count=len(top)))
    p = np.exp(ref_logp[ids])
    p_tail, q_tail = max(1.0 - float(p.sum()), 0.0), max(1.0 - float(q.sum()), 0.0)
    exact = len(top) == ref_logp.shape[0]
    kld = _xlogy(p, q) + (0.0 if exact else _xlogy(np.array([p_tail]), np.array([q_tail])))
    return max(kld, 0.0), "exact" if exact else "bound", len(top) + (0 if exact else 1)


def top_entries(logp_by_id: dict, tokenizer, n: int = 5) -> list:
    """The n most likely entries as [id, text, probability]."""
    best = sorted(logp_by_id.items(), key=lambda kv: -kv[1])[:n]
    return [[int(i), tokenizer.token_bytes(int(i)).decode("utf-8", "replace"), float(np.exp(v))] for i, v in best]


def step_metrics(ref_logp: np.ndarray, step, tokenizer, position: int) -> dict:
    """Every figure of one step: KLD (exact or bound), the reference's logprob and rank (1: its top) of the engine's
    token, the engine's own logprob of it, the reference's top-2 margin (nats), both sides' top entries."""
    kld, how, buckets = kld_step(ref_logp, step.top)
    tok = step.token
    order = np.argsort(-ref_logp, kind="stable")
    ref_by_id = {int(i): float(ref_logp[i]) for i in order[:5]}
    return {"kld": kld, "kld_kind": how, "buckets": buckets, "position": position, "token": tok,
            "token_text": step.text, "token_shared": step.shared, "ref_logprob": float(ref_logp[tok]),
            "engine_logprob": step.logprob, "logprob_diff": abs(float(ref_logp[tok]) - step.logprob),
            "rank": int(np.sum(ref_logp > ref_logp[tok])) + 1, "ref_top": int(order[0]),
            "margin": float(ref_logp[order[0]] - ref_logp[order[1]]),
            "top_reference": top_entries(ref_by_id, tokenizer), "top_engine": top_entries(step.top, tokenizer)}


def tokenization_row(engine, trace, ref_ids: list) -> Row:
    """Checkpoint 0: the engine's token ids of the prompt against the reference's (its tokenize route); where the
    engine has none, the round trip of its returned tokens: their bytes must give back the text it returned (up to
    the whitespace at its ends, end-of-generation tokens unrendered; else BlackBoxError: its ids cannot be trusted),
    and the prompt's token count where the engine tells it is the reference's."""
    band = {"agreement": 1.0}
    if trace.prompt_ids is not None:
        a, b = [int(t) for t in trace.prompt_ids], list(ref_ids)
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y),
                     None if len(a) == len(b) else min(len(a), len(b)))
        m = {"shape": [len(a)], "ref_shape": [len(b)], "agreement": 1.0 if a == b else 0.0, "ours": a, "reference": b,
             "how": trace.tokenized_by, "first_difference": first}
        if first is not None:
            name = lambda ids: repr(engine.tokenizer.token_bytes(ids[first]).decode("utf-8", "replace")) \
                if first < len(ids) and 0 <= ids[first] < engine.tokenizer.n_vocab else "(none)"   # noqa: E731
            m["first_difference_tokens"] = {"engine": name(a), "reference": name(b)}
        return Row("0", "tokenizer", None, "token_ids", m, band, within(m, band), (0, 0, 0))
    tok = engine.tokenizer
    eog = set(getattr(tok, "eog_ids", ()) or ())                   # an end-of-generation token is not rendered
    back = b"".join(tok.token_bytes(s.token) for s in trace.steps if s.token not in eog).decode("utf-8", "ignore")
    said = trace.completion_text or ""
    n = (trace.settings or {}).get("prompt_tokens")
    trip = back == said or back.strip() == said.strip()          # mistral.rs strips its message's ends
    if not trip:
        at = next((i for i, (x, y) in enumerate(zip(back, said)) if x != y), min(len(back), len(said)))
        raise BlackBoxError(f"the engine's tokens do not give back the text it returned (they differ at character "
                            f"{at}: {back[at:at + 20]!r} against {said[at:at + 20]!r}): its tokens cannot be "
                            f"matched to ids")
    same = n is None or n == len(ref_ids)
    m = {"shape": [len(trace.steps)], "agreement": 1.0 if same else 0.0, "how": "round trip of the returned tokens",
         "round_trip": trip, "text": said[:200], "tokens_text": back[:200],
         **({"prompt_tokens": n, "ref_prompt_tokens": len(ref_ids)} if n is not None else {})}
    return Row("0", "tokenizer", None, "round_trip", m, band, within(m, band), (0, 0, 0))


def compare_trace(engine, trace, bands: dict | None = None, require="auto", subject_label=None) -> DiffResult:
    """The trace against `engine` (the reference, in its own numerics) teacher-forced on the prompt and the trace's
    tokens: one forward over them, a row per step (module docstring). -> DiffResult (its verdict as every face's)."""
    tok = engine.tokenizer
    if tok is None:
        raise HarnessError("a black-box comparison needs the model's vocabulary (its tokens are named by it)")
    key, band = band_for(engine, bands)
    run_band = run_band_for(band, trace.engine)
    ref_ids = tok.encode(trace.prompt)
    ids = [int(t) for t in (trace.prompt_ids if trace.prompt_ids is not None else ref_ids)]
    if not ids:
        raise BlackBoxError("the engine's prompt has no tokens")
    fed = ids + [s.token for s in trace.steps[:-1]]
    if len(fed) > engine.n_ctx:
        raise BlackBoxError(f"{len(ids)} prompt and {len(trace.steps) - 1} engine tokens exceed the reference's "
                            f"context of {engine.n_ctx}")
    t0 = time.perf_counter()
    logp = log_softmax64(engine.logits(fed)[len(ids) - 1:])
    res = DiffResult(model=str(trace.settings.get("url") or trace.settings.get("model") or trace.engine),
                     reference_model=str(engine.path), prompt=trace.prompt, token_ids=ids,
                     band_class=f"{KIND}:{key}", specs=load_specs(), config=engine.config, require=require,
                     subject_label=subject_label or f"{trace.engine} {trace.version}".strip(),
                     reference_label=engine_label(engine))
    res.rows.append(tokenization_row(engine, trace, ref_ids))
    for j, step in enumerate(trace.steps):
        m = step_metrics(logp[j], step, tok, len(ids) - 1 + j)
        suffix = "" if j == 0 else f"@step{j}"
        kb = {"kld": band["kld"]}
        res.rows.append(Row("11", "softmax_probs", None, f"logprobs{suffix}", m, kb, within(m, kb), (1, j, 0), step=j))
        same = m["ref_top"] == step.token
        near = m["margin"] <= band["near_tie"]
        am = {"shape": [1], "agreement": 1.0 if same else 0.0, "near_tie": near, "margin": m["margin"],
              "token": step.token, "ref_top": m["ref_top"], "position": m["position"]}
        res.rows.append(Row("10", "greedy_argmax", None, f"argmax{suffix}", am,
                            {"agreement": 1.0, "near_tie": band["near_tie"]}, same or near, (1, j, 1), step=j))
    per_step = [r.metrics for r in res.rows if r.checkpoint == "11"]
    stats = run_statistics([m["kld"] for m in per_step], [m["ref_logprob"] for m in per_step],
                           [m["engine_logprob"] for m in per_step])
    if run_band is not None and stats["steps"] >= run_band["min_steps"]:
        rb = {"mean_kld": run_band["mean_kld"], "logprob_shift": run_band["logprob_shift"]}
        res.rows.append(Row("11", "softmax_probs", None, RUN, {**stats, "shape": [stats["steps"]]}, rb,
                            within(stats, rb), (2, 0, 0), step=len(trace.steps) - 1))
    elif run_band is not None:
        res.warnings.append(f"{stats['steps']} steps: the run-level band (mean KLD, log-probability shift) judges "
                            f"runs of at least {run_band['min_steps']}")
    res.sides = {"subject": {"engine": {"name": KIND, "kind": trace.engine, "version": trace.version},
                             "settings": trace.settings, "top_k": trace.top_k, "whole_vocabulary": trace.whole,
                             "tokenized_by": trace.tokenized_by, "chat": trace.chat, "stop_reason": trace.stop_reason},
                 "reference": {"engine": {"name": "llorch-ref"}, "arithmetic": {"numerics": engine.numerics,
                                                                               "kv_dtype": engine.kv_dtype}}}
    res.timings = {"reference_s": time.perf_counter() - t0}
    if not trace.whole:
        res.warnings.append(f"the engine gave its top {trace.top_k} log-probabilities a step: the KLD is a lower bound "
                            f"(the rest of the vocabulary lumped into one bucket on both sides)")
    if len(ref_ids) != len(ids) or ref_ids != ids:
        res.warnings.append("the engine tokenized the prompt otherwise: the reference runs on the engine's tokens")
    res.recipe = {"kind": "llorch", "model": str(engine.path), "token_ids": fed, "numerics": engine.numerics,
                  "kv_dtype": engine.kv_dtype, "blackbox": True}
    return res


def steps_table(res) -> list[dict]:
    """One line per step of a black-box result: KLD, rank and logprobs of the engine's token, near-tie, verdict."""
    by_step: dict = {}
    for r in res.rows:
        if r.checkpoint in ("10", "11") and r.tensor != RUN:
            by_step.setdefault(r.step, {})[r.checkpoint] = r
    out = []
    for j in sorted(by_step):
        p, a = by_step[j].get("11"), by_step[j].get("10")
        m = p.metrics
        out.append({"step": j, "position": m["position"], "token": m["token"], "text": m["token_text"],
                    "kld": m["kld"], "kld_kind": m["kld_kind"], "ref_logprob": m["ref_logprob"],
                    "engine_logprob": m["engine_logprob"], "rank": m["rank"], "margin": m["margin"],
                    "same_top": a.metrics["agreement"] == 1.0, "near_tie": a.metrics["near_tie"],
                    "passed": not (p.diverges or a.diverges)})
    return out


def divergence_lines(res) -> list[str]:
    """The first step outside its band, said with its position and the two distributions' top entries."""
    fd = res.first_divergence
    if fd is not None and fd["checkpoint"] == "0":
        m = next(r for r in res.rows if r.checkpoint == "0").metrics
        if m.get("first_difference") is None:
            return [f"  the prompt's tokenization: {m['how']} disagrees"]
        t = m["first_difference_tokens"]
        return [f"  the prompt's tokenization ({m['how']}) differs first at token {m['first_difference']}: the "
                f"engine's {t['engine']} against the reference's {t['reference']}"]
    if fd is None or fd["checkpoint"] not in ("10", "11"):
        return []
    if fd["tensor"] == RUN:
        m, b = run_row(res).metrics, run_row(res).band
        return [f"  the run over {m['steps']} steps: mean KLD {m['mean_kld']:.4g} nats (band {b['mean_kld']:.3g}), the "
                f"engine's token's log-probability shifted by {m['mean_shift']:+.4f} on average from the reference's "
                f"(band {b['logprob_shift']:.3g}); no single step left its band"]
    row = next(r for r in res.rows if r.checkpoint == "11" and r.step == fd["step"] and r.tensor != RUN)
    m = row.metrics

    def said(entries):
        return ", ".join(f"{t!r} {p:.4f}" for _, t, p in entries[:3])
    return [f"  step {fd['step']} (position {m['position']}): KLD {m['kld']:.4g} nats ({m['kld_kind']}; band "
            f"{row.band['kld']:.3g}), the engine's token {m['token_text']!r} ranked {m['rank']} by the reference "
            f"(logprob {m['ref_logprob']:.4f}, the engine's {m['engine_logprob']:.4f})",
            f"  reference top: {said(m['top_reference'])}; engine top: {said(m['top_engine'])}"]


def judge_table(table: list, band: dict, run_band: dict | None) -> dict:
    """The verdict's rule on a steps_table (kept figures, no reference run): the first step whose KLD leaves the
    band or whose token is neither the reference's top nor a near tie, and whether the run-level row fails (judged
    where the run has run_band's min_steps) -> {"step", "by": "kld" | "argmax" | "run" | None, "run_failed",
    "stats"}."""
    first, by = None, None
    for s in table:
        if s["kld"] > band["kld"]:
            first, by = s["step"], "kld"
        elif not s["same_top"] and s["margin"] > band["near_tie"]:
            first, by = s["step"], "argmax"
        if first is not None:
            break
    stats = run_statistics([s["kld"] for s in table], [s["ref_logprob"] for s in table],
                           [s["engine_logprob"] for s in table])
    run_failed = run_band is not None and stats["steps"] >= run_band["min_steps"] and not within(
        stats, {"mean_kld": run_band["mean_kld"], "logprob_shift": run_band["logprob_shift"]})
    if first is None and run_failed:
        first, by = table[-1]["step"], "run"
    return {"step": first, "by": by, "run_failed": run_failed, "stats": stats}


def run_row(res):
    """The run-level row of a black-box result (None where the run was too short to judge)."""
    return next((r for r in res.rows if r.tensor == RUN), None)
