"""Dump the model from several engines and diff each dump against llorch-ref: one table of worst figures.

    python tools/subject_tables.py --model SmolLM2-135M-Instruct.F32.gguf --out results/cpu/2026-11-26-dump-subjects.md

Engines: llama.cpp (its eval callback; GGUF), transformers (forward hooks; the GGUF converted to an HF
folder), the PyTorch test engine (tests/subjects/torch_llama.py; head-major, NeoX pairs). Each is written
as a llorch-dump file with `llorch-ref dump` (or the Recorder), then compared by the same code as
`llorch-ref diff --subject`.
"""
from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

from markdown_out import emit

ROOT = Path(__file__).resolve().parents[1]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompt", default="Once upon a time, there was a little")
    ap.add_argument("--greedy", type=int, default=32)
    ap.add_argument("--engines", default="llamacpp,transformers,torch")
    ap.add_argument("--out")
    a = ap.parse_args()
    import llorch_ref
    from llorch_ref.checkpoints import band_class_of
    from llorch_ref.dump import load_dump
    from llorch_ref.harness.compare import compare_dumps
    from llorch_ref.harness.metrics import summary_markdown
    from llorch_ref.harness.run import check_same_model
    from llorch_ref.references.llorch import record_engine

    eng = llorch_ref.load(a.model)
    ids = eng.tokenizer.encode(a.prompt)
    tmp = Path(tempfile.mkdtemp(prefix="llorch-subjects-"))
    results = {}
    for e in a.engines.split(","):
        out = tmp / f"{e}.safetensors"
        if e == "torch":
            sys.path.insert(0, str(ROOT / "tests"))
            from subjects.torch_llama import make_dump
            rec = make_dump(a.model, ids)
            rec.save(out)
            cmd = "tests/subjects/torch_llama.py make_dump (Recorder)"
        else:
            cmd = ["llorch-ref", "dump", "--engine", e, "--model", a.model, "--prompt", a.prompt,
                   "--greedy", str(a.greedy), "--out", str(out)]
            subprocess.run(cmd, check=True)
            cmd = shlex.join(cmd[:-2] + ["--out", f"{e}.safetensors"])
        sub = load_dump(out)
        n = len(sub.raw("12", "greedy_tokens")) if sub.has("12", "greedy_tokens") else 0
        ref = record_engine(eng, sub.token_ids, prompt=sub.manifest.get("prompt"), n_greedy=n)
        res = compare_dumps(sub, ref, eng.config, band_class_of(eng.tensor_types))
        results[e] = (sub, res, cmd, check_same_model(sub, eng))
    lines = [f"# Subjects against llorch-ref on `{Path(a.model).name}`", "",
             f"Command: `python tools/subject_tables.py --model {a.model} --engines {a.engines}`; prompt "
             f"{a.prompt!r} ({len(ids)} tokens). Each engine writes a llorch-dump file, compared with the code of "
             f"`llorch-ref diff --subject` (reference: llorch-ref, numpy, exact). Worst figure over all layers and "
             f"tensors of each checkpoint; `n/c` = not covered by that engine's dump.", ""]
    for sub, res, cmd, warn in results.values():
        lines += [f"## {sub.engine}", "", f"- dump: `{cmd}`; layouts `{sub.layouts}`",
                  f"- first divergence: {res.first_divergence or 'none'}"]
        if warn:
            lines.append(f"- note: {warn}")
        lines += [""] + summary_markdown(res.summary())
        lines.append("")
    emit(lines, a.out)


if __name__ == "__main__":
    main()
