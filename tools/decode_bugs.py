"""The five planted decode-only bugs (llorch_ref.testing.plant.DECODE_BUGS) in a subject engine on a real
model: each subject records the prompt and N decode steps with the bug, the reference runs the same tokens
clean, and the table says where each is named (step, checkpoint, layer, tensor) and by which figure.

    python tools/decode_bugs.py [--model M] [--steps 3] [--numerics exact|ggml] --out results/decode/planted-decode-bugs.md
"""
from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

import pytest

import llorch_ref
from llorch_ref.checkpoints import engine_band_class
from llorch_ref.harness.bundle import cpu_model
from llorch_ref.harness.compare import compare_dumps
from llorch_ref.references.llorch import record_engine
from llorch_ref.testing.plant import DECODE_BUGS

PROMPT = "Once upon a time, there was a little"


def run_one(eng, plant, config, steps):
    ids = eng.tokenizer.encode(PROMPT)
    if config:
        eng.config = dataclasses.replace(eng.config, **config)
    with pytest.MonkeyPatch.context() as mp:
        plant(mp, len(ids))
        sub = record_engine(eng, ids, n_greedy=0, decode_steps=steps).to_dump()
    ref = record_engine(eng, ids, n_greedy=0, decode_ids=sub.decode_token_ids).to_dump()
    return compare_dumps(sub, ref, eng.config, engine_band_class(eng), local_engine=eng)


def main():
    ap = argparse.ArgumentParser(allow_abbrev=False)
    ap.add_argument("--model", default=None)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--numerics", default="exact")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    lines = [f"# Planted decode-only bugs, {a.steps} decode steps", "",
             f"`python tools/decode_bugs.py --steps {a.steps} --numerics {a.numerics}"
             + (f" --model {a.model}" if a.model else "") + f" --out {a.out}` on {cpu_model()}; prompt "
             f"{PROMPT!r}. The subject is llorch-ref with the bug planted while it records the prompt and its own "
             f"greedy decode steps; the reference is llorch-ref, clean, fed the subject's tokens (teacher forcing).", "",
             "| planted bug | named at (step, checkpoint, layer, tensor) | by | expected | local NMSE there (band) | "
             "end-to-end NMSE there | prompt's forward |", "|---|---|---|---|---|---|---|"]
    for name, (plant, config, expect) in DECODE_BUGS.items():
        eng = llorch_ref.load(a.model, numerics=a.numerics, weights="eager")
        if config and "sliding_window" in config:
            config = {**config, "local_layers": (True,) * eng.config.n_layers}
        t0 = time.perf_counter()
        res = run_one(eng, plant, config, a.steps)
        fd = res.first_divergence
        row = min((r for r in res.rows if r.diverges), key=lambda r: r.order) if fd else None
        got = (fd["step"], fd["checkpoint"], fd["layer"], fd["tensor"]) if fd else None
        step0 = "passes" if not any(r.diverges for r in res.rows if r.step == 0 and r.checkpoint != "12") else "diverges"
        lines.append(f"| {name} | {got} | {fd['by'] if fd else '-'} | {expect}{'' if got == expect else ' **(other)**'} | "
                     + (f"{row.local['nmse']:.3g} ({row.local_band['nmse']:g})" if row is not None and row.local
                        and 'nmse' in row.local else "-")
                     + f" | {row.metrics.get('nmse', float('nan')):.3g} | {step0} |" if row is not None else " - | - |")
        print(name, got, f"{time.perf_counter() - t0:.1f} s", flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text("\n".join(lines) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
