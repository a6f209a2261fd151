"""Gemma 3 270M with a prompt that crosses its sliding window (512 tokens), and decode steps after it: llama.cpp
and transformers each dump the prompt (chosen rows) and N decode steps; the reference, llorch-ref in the
arithmetic each declares, runs the same tokens; the table says, per engine and step, how many comparisons
passed, the worst end-to-end and local figures, and where the first divergence is (if any).

    python tools/gemma_window.py [--model gemma3-270m] [--tokens 600] [--steps 4] [--rows every:32]
        [--engines llamacpp,transformers] --out results/decode/gemma3-270m-window.md
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import llorch_ref
from llorch_ref.checkpoints import engine_band_class
from llorch_ref.dump import parse_rows
from llorch_ref.harness.bundle import cpu_model
from llorch_ref.harness.metrics import fmt
from llorch_ref.harness.run import run_subject
from llorch_ref.loaders.default_model import resolve_model
from llorch_ref.references.engines import dump_llamacpp, dump_transformers

sys.path.insert(0, str(Path(__file__).parent))
from long_context import TEXT, prompt_of  # noqa: E402


def step_lines(res, engine: str, steps: int) -> list[str]:
    out = []
    for k in range(steps + 1):
        rows = [r for r in res.rows if r.step == k and "nmse" in r.metrics]
        local = [r for r in rows if r.local is not None and "nmse" in r.local]
        worst = max(rows, key=lambda r: r.metrics["nmse"])
        wl = max(local, key=lambda r: r.local["nmse"]) if local else None
        out.append(f"| {engine} | {'prompt' if k == 0 else k} | {len(rows)} | {sum(not r.passed for r in rows)} | "
                   f"{sum(r.metrics.get('max_abs') == 0 for r in rows)} | {fmt(worst.metrics['nmse'])} "
                   f"({worst.tensor.split('@')[0]} L{worst.layer}) | {len(local)} | "
                   f"{sum(r.local_passed is False for r in local)} | "
                   + ("-" if wl is None else f"{fmt(wl.local['nmse'])} ({wl.tensor.split('@')[0]} L{wl.layer})") + " |")
    return out


def main():
    ap = argparse.ArgumentParser(allow_abbrev=False)
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--tokens", type=int, default=600)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--rows", default="every:32")
    ap.add_argument("--engines", default="llamacpp,transformers")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    path = resolve_model(a.model)
    exact = llorch_ref.load(path)
    cfg = exact.config
    prompt = prompt_of(exact.tokenizer, TEXT.read_text(encoding="utf-8"), a.tokens)
    ids = exact.tokenizer.encode(prompt)
    rows = parse_rows(a.rows, len(ids))
    assert len(ids) > cfg.sliding_window, "the prompt must cross the sliding window"
    lines = [f"# {path.name}: a {len(ids)}-token prompt across the {cfg.sliding_window}-token sliding window, "
             f"and {a.steps} decode steps", "",
             f"`python tools/gemma_window.py --tokens {a.tokens} --steps {a.steps} --rows {a.rows} --engines "
             f"{a.engines} --out {a.out}` on {cpu_model()}. Text: the first {len(ids)} tokens of `{TEXT}`. Rows kept "
             f"of the prompt: {len(rows)} ({a.rows}); decode steps: every tensor. The reference runs each engine's "
             f"tokens (teacher forcing) in the arithmetic the engine declares; end-to-end bands: class "
             f"{engine_band_class(exact)}. {sum(cfg.is_local(i) for i in range(cfg.n_layers))} of {cfg.n_layers} "
             f"layers are local (sliding window).", "",
             "| engine | step | comparisons | off the band | bit-equal | worst end-to-end NMSE | local checks | "
             "local checks failed | worst local NMSE |", "|---|---|---|---|---|---|---|---|---|"]
    notes = []
    for engine in a.engines.split(","):
        t0 = time.perf_counter()
        if engine == "llamacpp":
            d = dump_llamacpp(path, prompt=prompt, token_ids=ids, n_greedy=8, decode_steps=a.steps, rows=rows)
            ref = llorch_ref.load(path, numerics="ggml")
        else:
            d = dump_transformers(path, prompt=prompt, token_ids=ids, n_greedy=8, decode_steps=a.steps, rows=rows)
            ref = exact
        t_dump = time.perf_counter() - t0
        res = run_subject(ref, d.to_dump(), engine_band_class(exact))
        lines += step_lines(res, f"{d.engine} {d.version}".split(" (")[0], a.steps)
        fd = res.first_divergence
        notes.append(f"- {engine}: dump {t_dump:.0f} s, comparison {time.perf_counter() - t0 - t_dump:.0f} s; "
                     f"first divergence: {fd or 'none'}; greedy {res.greedy.get('equal_prefix')}/"
                     f"{res.greedy.get('n')} tokens equal; not covered: {len(res.not_covered)}"
                     + (f" (e.g. {res.not_covered[0]['why']})" if res.not_covered else "") + ".")
        print(lines[-a.steps - 1:], notes[-1], sep="\n", flush=True)
    lines += [""] + notes
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text("\n".join(lines) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
