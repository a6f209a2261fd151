"""What a proof bundle of a black-box engine holds beside the pages every bundle has:

    trace.json     the engine's run as it answered: engine, version, settings, the prompt and its tokenization,
                   each step's chosen token (text, shared), the entries no id could be given to (ambiguous)
    trace.npz      its numbers: token [S], logprob [S], top_n [S] (entries a step), top_ids and top_logprobs
                   (every step's entries, one after the other)
    steps.md       the per-step table (KLD, the engine's token with its rank and both log-probabilities, the
                   reference's top-2 margin, near ties, the verdict) and, at the first divergence, the two
                   distributions' top entries

result.json keeps the same under "blackbox" (steps_json). The trace is the subject's side: `verify` runs the
reference teacher-forced on it again (the recipe of kind "blackbox") and redoes every step's figures.
"""
from __future__ import annotations

import io
import json
import zipfile
from pathlib import Path

import numpy as np

from ..errors import HarnessError
from ..references.blackbox import Step, Trace
from .blackbox import KIND, RUN, divergence_lines, steps_table
from .run import recipe as make_recipe
from .text_safety import for_markdown as md

TRACE_JSON, TRACE_NPZ, STEPS_MD = "trace.json", "trace.npz", "steps.md"
NPY_HEADER = 1 << 16


def is_blackbox(result) -> bool:
    return str(result.band_class or "").startswith(f"{KIND}:")


def recipe(engine, trace) -> dict:
    """How verify runs the reference side again: the model and its arithmetic, the tokens it was fed (the
    prompt's ids and the engine's tokens but the last), the trace it is compared with."""
    ids = [int(t) for t in (trace.prompt_ids if trace.prompt_ids is not None else engine.tokenizer.encode(trace.prompt))]
    return make_recipe("blackbox", engine.path, ids + [s.token for s in trace.steps[:-1]], prompt=trace.prompt,
                       n_greedy=0, backend=engine.backend.name, numerics=engine.numerics, kv_dtype=engine.kv_dtype,
                       ggml_simd=engine.ggml_simd, trace=TRACE_NPZ)


def trace_json(trace) -> dict:
    return {"engine": trace.engine, "version": trace.version, "prompt": trace.prompt, "prompt_ids": trace.prompt_ids,
            "tokenized_by": trace.tokenized_by, "top_k": trace.top_k, "whole": trace.whole,
            "completion_text": trace.completion_text, "settings": trace.settings, "chat": trace.chat,
            "stop_reason": trace.stop_reason,
            "steps": [{"text": s.text, "shared": s.shared, "ambiguous": s.ambiguous} for s in trace.steps]}


def write_trace(d: Path, trace):
    """trace.json and trace.npz of one trace into the bundle's folder d."""
    (d / TRACE_JSON).write_text(json.dumps(trace_json(trace), indent=1) + "\n")
    steps = trace.steps
    np.savez_compressed(d / TRACE_NPZ, token=np.array([s.token for s in steps], np.int64),
                        logprob=np.array([s.logprob for s in steps], np.float64),
                        top_n=np.array([len(s.top) for s in steps], np.int64),
                        top_ids=np.array([i for s in steps for i in s.top], np.int64),
                        top_logprobs=np.array([v for s in steps for v in s.top.values()], np.float64))


def _read_npz(p: Path, most: dict) -> dict:
    """trace.npz's members, each a numeric array of at most most[name] elements, checked ahead of reading its
    data (declared size, header); anything else is refused with one line."""
    out = {}
    try:
        with zipfile.ZipFile(p) as z:
            for info in z.infolist():
                name = info.filename[:-4]
                if name not in most or info.file_size > most[name] * 8 + NPY_HEADER:
                    raise HarnessError(f"{p}: member {info.filename[:80]!r} is not a trace's, or larger than the "
                                       f"recipe's steps and vocabulary allow: refused unread")
                with z.open(info) as f:
                    data = f.read(info.file_size + 1)
                f = io.BytesIO(data)
                version = np.lib.format.read_magic(f)
                read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
                shape, _, dtype = read(f)
                if dtype.hasobject or dtype.kind not in "iuf" or int(np.prod(shape)) > most[name]:
                    raise HarnessError(f"{p}: {name} is {dtype} of shape {list(shape)[:4]}: not a trace's numbers")
                f.seek(0)
                out[name] = np.lib.format.read_array(f, allow_pickle=False)
    except zipfile.BadZipFile as e:
        raise HarnessError(f"{p}: not an .npz (zip) file ({e})") from None
    except (ValueError, OSError, EOFError, RuntimeError) as e:
        raise HarnessError(f"{p}: a damaged trace ({type(e).__name__}: {str(e)[:120]})") from None
    missing = set(most) - set(out)
    if missing:
        raise HarnessError(f"{p}: no {sorted(missing)[0]}: not a trace llorch-ref writes")
    return out


def read_trace(folder: Path, n_steps: int, n_vocab: int, text: str) -> Trace:
    """The bundle's trace (trace.json as `text`, trace.npz read under the bounds of n_steps steps of at most
    n_vocab entries) as a Trace; HarnessError where the two disagree or break the bounds."""
    try:
        meta = json.loads(text)
        steps_meta = meta["steps"]
    except (ValueError, KeyError, TypeError):
        raise HarnessError(f"{folder / TRACE_JSON}: not a trace llorch-ref writes") from None
    a = _read_npz(folder / TRACE_NPZ, {"token": n_steps, "logprob": n_steps, "top_n": n_steps,
                                       "top_ids": n_steps * n_vocab, "top_logprobs": n_steps * n_vocab})
    n, counts = len(a["token"]), a["top_n"]
    if not (len(a["logprob"]) == len(counts) == n == len(steps_meta) == n_steps) or int(counts.sum()) != \
            len(a["top_ids"]) or len(a["top_ids"]) != len(a["top_logprobs"]) or (counts < 0).any():
        raise HarnessError(f"{folder / TRACE_NPZ}: {n} steps against the recipe's {n_steps}, or entries that do not "
                           f"add up: not a trace llorch-ref writes")
    if ((a["top_ids"] < 0) | (a["top_ids"] >= n_vocab)).any() or ((a["token"] < 0) | (a["token"] >= n_vocab)).any():
        raise HarnessError(f"{folder / TRACE_NPZ}: a token id outside the model's vocabulary of {n_vocab}")
    ends = np.cumsum(counts)
    steps = []
    for j, m in enumerate(steps_meta):
        lo, hi = int(ends[j] - counts[j]), int(ends[j])
        top = dict(zip(a["top_ids"][lo:hi].tolist(), a["top_logprobs"][lo:hi].tolist()))
        steps.append(Step(token=int(a["token"][j]), logprob=float(a["logprob"][j]), top=top,
                          ambiguous=dict(m.get("ambiguous") or {}), text=str(m.get("text", "")),
                          shared=bool(m.get("shared"))))
    return Trace(engine=str(meta.get("engine")), version=str(meta.get("version")), prompt=str(meta.get("prompt")),
                 steps=steps, top_k=int(meta.get("top_k") or 0), whole=bool(meta.get("whole")),
                 prompt_ids=meta.get("prompt_ids"), tokenized_by=meta.get("tokenized_by"),
                 completion_text=meta.get("completion_text"), settings=dict(meta.get("settings") or {}),
                 chat=bool(meta.get("chat")), stop_reason=meta.get("stop_reason"))


def steps_json(result) -> dict:
    """result.json's "blackbox": one line per step, and the first divergence's two distributions' top entries."""
    fd = result.first_divergence
    at = None
    if fd is not None and fd["checkpoint"] in ("10", "11"):
        m = next(r for r in result.rows if r.checkpoint == "11" and r.step == fd["step"] and r.tensor != RUN).metrics
        at = {"step": fd["step"], "position": m["position"], "top_reference": m["top_reference"],
              "top_engine": m["top_engine"]}
    return {"steps": steps_table(result), "divergence": at}


def steps_md(result, run_id: str) -> str:
    """steps.md: the per-step table and the divergence's two distributions."""
    lines = [f"# Proof run {md(run_id)}: {md(result.subject_label)} step by step", "",
             "The reference runs teacher-forced on the prompt and the engine's own tokens; each step compares the "
             "distribution after it. KLD in nats (exact over the vocabulary, or a lower bound with the rest of the "
             "vocabulary lumped); rank: the reference's rank of the engine's token (1: its top); margin: the "
             "reference's top-2 log-probability margin (a near tie under the band lets the tokens differ).", "",
             "| step | position | token | KLD | kind | rank | reference logprob | engine logprob | margin | verdict |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for s in steps_table(result):
        verdict = ("pass" if s["passed"] else "**FAIL**") + (" (near tie)" if s["near_tie"] and not s["same_top"]
                                                            else "")
        lines.append(f"| {s['step']} | {s['position']} | {md(repr(s['text']))} | {s['kld']:.4g} | {s['kld_kind']} | "
                     f"{s['rank']} | {s['ref_logprob']:.4f} | {s['engine_logprob']:.4f} | {s['margin']:.3f} | "
                     f"{verdict} |")
    div = divergence_lines(result)
    lines += ["", "First divergence:" if div else "First divergence: none (every step inside its band)."]
    if div:
        at = steps_json(result)["divergence"]
        lines += [""] + [md(d.strip()) for d in div] + ["", "| rank | reference | p | engine | p |", "|---|---|---|---|---|"]
        for k, (r, e) in enumerate(zip(at["top_reference"], at["top_engine"]), 1):
            lines.append(f"| {k} | {md(repr(r[1]))} ({r[0]}) | {r[2]:.4f} | {md(repr(e[1]))} ({e[0]}) | {e[2]:.4f} |")
    return "\n".join(lines) + "\n"
