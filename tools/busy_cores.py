"""How much a busy machine slows each engine: `llorch-ref bench` (numpy, numba, llama.cpp) on the default model
with 0, 1 and 2 other cores kept busy (one spinning Python process per busy core), at --threads 2 and 1, and the
slowdown of each engine against its own idle figure. Writes results/cpu/busy-cores.md and .json.

    python tools/busy_cores.py [--prefill 64 --decode 64 --repeats 3] [--out results/cpu/busy-cores]

--out: the path of the two files without their .md and .json (another machine's figures beside the earlier ones).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from llorch_ref.harness.bundle import cpu_flags, cpu_model

ROOT = Path(__file__).resolve().parents[1]
SPIN = "while True: pass"


def bench(threads, a, tmp):
    out = Path(tmp) / f"b{threads}.json"
    subprocess.run([sys.executable, "-m", "llorch_ref.cli", "bench", "--engines", "numpy,numba,llamacpp",
                    "--prefill", str(a.prefill), "--decode", str(a.decode), "--repeats", str(a.repeats),
                    "--threads", str(threads), "--json", str(out), "--overwrite"], check=True, capture_output=True,
                   env={**__import__("os").environ, "LLORCH_BENCH_VECTOR_REGISTERS": "0"})
    return {r["engine"].split()[0 if r["engine"] == "llama.cpp" else 1]: r for r in json.loads(out.read_text())["results"]}


def main():
    import tempfile
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefill", type=int, default=64)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "results" / "cpu" / "busy-cores"))
    a = ap.parse_args()
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for busy in (0, 1, 2):
            spinners = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(busy)]
            try:
                for threads in (2, 1):
                    runs[(busy, threads)] = bench(threads, a, tmp)
                    r = runs[(busy, threads)]
                    print(busy, threads, {k: round(v.get("decode_tok_s", 0), 1) for k, v in r.items()}, flush=True)
            finally:
                for p in spinners:
                    p.kill()
    engines = ["numpy", "numba", "llama.cpp"]
    lines = ["# A busy machine: decode and prefill speed with other cores kept busy", "",
             f"`python {' '.join(sys.argv)}` (--prefill {a.prefill} --decode {a.decode} --repeats {a.repeats}) on "
             f"{cpu_model()} ({cpu_flags()}), 2 cores: `llorch-ref bench --engines numpy,numba,llamacpp --threads T` "
             f"(default model) while 0, 1 or 2 other processes spin on the cores. tok/s medians of {a.repeats}; the "
             f"slowdown is each engine's idle figure (same T) over its busy one.", "",
             "| busy cores | threads | " + " | ".join(f"{e} decode tok/s (slowdown)" for e in engines) + " | "
             + " | ".join(f"{e} prefill tok/s (slowdown)" for e in engines) + " |",
             "|---|---|" + "---|" * (2 * len(engines))]
    for (busy, threads), r in runs.items():
        idle = runs[(0, threads)]
        cell = lambda e, k, r=r, idle=idle: (f"{r[e][k]:.1f} ({idle[e][k] / r[e][k]:.2f}x)"
                                             if e in r and "error" not in r[e] else "error")
        lines.append(f"| {busy} | {threads} | " + " | ".join(cell(e, "decode_tok_s") for e in engines) + " | "
                     + " | ".join(cell(e, "prefill_tok_s") for e in engines) + " |")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_name(out.name + ".md").write_text("\n".join(lines) + "\n")
    out.with_name(out.name + ".json").write_text(json.dumps({f"{b}-{t}": r for (b, t), r in runs.items()}, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
