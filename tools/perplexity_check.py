"""llorch-ref eval against llama.cpp's own llama-perplexity --kl-divergence, side by side, on the same files, text,
tokens and context: llama-perplexity saves the base logits of --base (llama.cpp on it) and scores --subject
against them; llorch-ref eval scores llama.cpp on --subject against llorch-ref (numpy, exact) on --base.

    bash tools/build_llama_perplexity.sh                      # once: the binary from the 0.3.36 sdist's llama.cpp
    python tools/perplexity_check.py --binary BIN --base F32.gguf --subject Q4_1.gguf [--ctx 512] [--chunks 20]
        --out results/eval/llama-perplexity-side-by-side.md
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from llorch_ref.harness.bundle import cpu_model
from llorch_ref.loaders.corpus import NAME, default_corpus_path

LINE = re.compile(r"^\s*(?P<name>[^:]+?)\s*:\s*(?P<v>-?[0-9.]+)(?:\s*%)?(?:\s*±\s*(?P<u>[0-9.]+))?\s*%?\s*$")
PCT = re.compile(r"^\s*(?P<name>(?:Maximum|Minimum|Median|Mean|[0-9. ]+%)\s+(?:KLD|Δp)):\s*(?P<v>-?[0-9.]+)\s*%?"
                 r"(?:\s*±\s*(?P<u>[0-9.]+)\s*%?)?\s*$")


def parse(text: str) -> dict:
    """llama-perplexity's statistics block -> {name: (value, uncertainty or None)}, names normalized to
    llorch-ref's (single spaces; Δp and Same top p in percent as printed)."""
    out = {}
    for line in text.splitlines():
        m = PCT.match(line) or LINE.match(line)
        if m and ("PPL" in m["name"] or "KLD" in m["name"] or "Δp" in m["name"] or "top p" in m["name"]):
            name = " ".join(m["name"].split())
            out[name] = (float(m["v"]), None if m["u"] is None else float(m["u"]))
    return out


def main():
    ap = argparse.ArgumentParser(allow_abbrev=False)
    ap.add_argument("--binary", required=True)
    ap.add_argument("--base", required=True)
    ap.add_argument("--subject", required=True)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=20)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    text = default_corpus_path()
    flags = ["-c", str(a.ctx), "--chunks", str(a.chunks), "-b", str(a.ctx), "-ub", str(a.ctx), "-t", "2",
             "-fa", "off", "-ctk", "f32", "-ctv", "f32", "--no-repack"]
    with tempfile.TemporaryDirectory() as tmp:
        kld = Path(tmp) / "base.kld"
        t0 = time.perf_counter()
        r = subprocess.run([a.binary, "-m", a.base, "-f", str(text), "--kl-divergence-base", str(kld)] + flags,
                           capture_output=True, text=True)
        if r.returncode:
            sys.exit(r.stderr[-3000:])
        r = subprocess.run([a.binary, "-m", a.subject, "--kl-divergence-base", str(kld), "--kl-divergence"] + flags,
                           capture_output=True, text=True)
        t_theirs = time.perf_counter() - t0
        if r.returncode:
            sys.exit(r.stderr[-3000:])
        theirs = parse(r.stdout + "\n" + r.stderr)
        js = Path(tmp) / "ours.json"
        t0 = time.perf_counter()
        e = subprocess.run([sys.executable, "-m", "llorch_ref.cli", "eval", "--model", a.base, "--subject", "llamacpp",
                            "--subject-model", a.subject, "--ctx", str(a.ctx), "--chunks", str(a.chunks), "--json",
                            str(js)], capture_output=True, text=True)
        t_ours = time.perf_counter() - t0
        if e.returncode:
            sys.exit(e.stderr[-3000:])
        ours = json.loads(js.read_text())
    lines = ["# llorch-ref eval and llama-perplexity --kl-divergence, side by side", "",
             f"`python tools/perplexity_check.py --base {Path(a.base).name} --subject {Path(a.subject).name} --ctx "
             f"{a.ctx} --chunks {a.chunks} ...` on {cpu_model()}; text: {NAME}; llama.cpp settings on both sides: "
             f"F32 K/V cache, flash attention off, n_batch = n_ubatch = {a.ctx}, 2 threads, no weight repacking (llama-perplexity --no-repack; the capture's use_extra_bufts=False; with repacking this CPU's AMX kernel segfaults on Q8_0).", "",
             f"- llama-perplexity (from the llama-cpp-python 0.3.36 sdist's llama.cpp): base = llama.cpp on "
             f"{Path(a.base).name}, its log-probabilities stored as 16 bits (scale and minimum per row, those below "
             f"max - 16 dropped from the KLD sum); {t_theirs:.0f} s for both passes.",
             f"- llorch-ref eval: base = llorch-ref (numpy, exact float32) on {Path(a.base).name}, float64 "
             f"log-probabilities, every vocabulary entry; subject = llama.cpp on {Path(a.subject).name}; {t_ours:.0f} s.",
             "", "| statistic | llama-perplexity | llorch-ref eval | difference |", "|---|---|---|---|"]
    for name, (v, u) in theirs.items():
        mine = ours["statistics"].get(name)
        if mine is None:
            lines.append(f"| {name} | {v}{'' if u is None else f' ± {u}'} | (not printed) | |")
            continue
        m, mu = (mine if isinstance(mine, list) else (mine, None))
        scale = 100.0 if ("Δp" in name or name == "Same top p" or name.startswith("Cor")) else 1.0
        m, mu = m * scale, None if mu is None else mu * scale
        lines.append(f"| {name} | {v:.6f}{'' if u is None else f' ± {u:.6f}'} | {m:.6f}"
                     f"{'' if mu is None else f' ± {mu:.6f}'} | {m - v:+.6f} |")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
