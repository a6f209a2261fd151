"""Planted engine bugs in a subject engine on a real model: the decode-only bugs (llorch_ref.testing.plant.
DECODE_BUGS) and the cache bugs (CACHE_BUGS), the latter also in dumps of the last prompt row only (as `dump
--rows last` writes). Each subject records the prompt and N decode steps with the bug, the reference runs the
same tokens clean (run_subject, as `diff --subject`), and the table gives the verdict and where it names the bug
(step, checkpoint, layer, tensor, cache positions) by which figure.

    python tools/decode_bugs.py [--model M] [--steps 3] [--numerics exact|ggml] [--bugs decode,cache] --out F.md
"""
from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

import pytest
from made_at import commit

import llorch_ref
from llorch_ref.checkpoints import engine_band_class
from llorch_ref.harness.bundle import cpu_model
from llorch_ref.harness.run import run_subject
from llorch_ref.references.llorch import record_engine
from llorch_ref.testing.plant import CACHE_BUGS, DECODE_BUGS

PROMPT = "Once upon a time, there was a little"


def run_one(eng, plant, config, steps, rows=None):
    ids = eng.tokenizer.encode(PROMPT)
    if config:
        eng.config = dataclasses.replace(eng.config, **config)
    with pytest.MonkeyPatch.context() as mp:
        plant(mp, len(ids))
        sub = record_engine(eng, ids, prompt=PROMPT, n_greedy=8, decode_steps=steps,
                            rows=None if rows is None else [len(ids) - 1]).to_dump()
    return run_subject(eng, sub, engine_band_class(eng))


def cases(which, steps):
    """-> [(name, plant, config, steps, rows, expected place)] of the bug sets asked for."""
    out = []
    if "decode" in which:
        out += [(n, p, c, steps, None, e) for n, (p, c, e) in DECODE_BUGS.items()]
    if "cache" in which:
        out += [(n, p, None, steps, None, e) for n, (p, e) in CACHE_BUGS.items()]
        out += [(f"{n}, last row only", p, None, 0, "last", (0, "3", 0, "k_cache"))
                for n, (p, e) in CACHE_BUGS.items() if e[0] == 0]
    return out


def main():
    ap = argparse.ArgumentParser(allow_abbrev=False)
    ap.add_argument("--model", default=None)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--numerics", default="exact")
    ap.add_argument("--bugs", default="decode,cache", help="decode, cache or both")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    lines = [f"# Planted engine bugs and the verdict, {a.steps} decode steps", "",
             f"`python tools/decode_bugs.py --steps {a.steps} --numerics {a.numerics} --bugs {a.bugs}"
             + (f" --model {a.model}" if a.model else "") + f" --out {a.out}` at commit {commit()} on {cpu_model()}; "
             f"prompt {PROMPT!r}. The subject is llorch-ref with the bug planted while it records the prompt and its "
             f"own greedy decode steps; the reference is llorch-ref, clean, fed the subject's tokens (teacher "
             f"forcing), judged by run_subject as `diff --subject` judges a dump.", "",
             "| planted bug | verdict | named at (step, checkpoint, layer, tensor) | cache positions | by | expected | "
             "local NMSE there (band) | end-to-end NMSE there |", "|---|---|---|---|---|---|---|---|"]
    for name, plant, config, steps, rows, expect in cases(a.bugs, a.steps):
        eng = llorch_ref.load(a.model, numerics=a.numerics, weights="eager")
        if config and "sliding_window" in config:
            config = {**config, "local_layers": (True,) * eng.config.n_layers}
        t0 = time.perf_counter()
        res = run_one(eng, plant, config, steps, rows)
        v = res.verdict()
        fd = v.first_divergence
        row = min((r for r in res.rows if r.diverges), key=lambda r: r.order) if fd else None
        got = (fd["step"], fd["checkpoint"], fd["layer"], fd["tensor"]) if fd else None
        local = (f"{row.local['nmse']:.3g} ({row.local_band['nmse']:g})" if row is not None and row.local
                 and "nmse" in row.local and "nmse" in row.local_band else "-")
        unheld = (row.local or {}).get("unheld_rows_end_to_end") if row is not None else None
        if unheld:               # the rows no forward held, end to end in the end-to-end band
            local += f"; unheld rows {unheld['nmse']:.3g} ({row.band['nmse']:g}, end to end)"
        lines.append(f"| {name} | {v.status} | {got} | {fd.get('positions', '-') if fd else '-'} | "
                     f"{fd['by'] if fd else '-'} | {expect}{'' if got == expect else ' **(other)**'} | {local} | "
                     f"{row.metrics.get('nmse', float('nan')):.3g} |" if row is not None else " - | - |")
        print(name, v.status, got, f"{time.perf_counter() - t0:.1f} s", flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text("\n".join(lines) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
