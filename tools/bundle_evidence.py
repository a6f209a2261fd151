"""The evidence of the reviewer bundles: two runs on the default model (a passing F32 run, and a llama.cpp dump of a
copy with blk.11.ffn_up's block scales x1.05, checked against the clean Q4_1 file), each with its tensors;
screenshots of their report.html in headless Chromium; `llorch-ref verify` on the untouched bundle and on a copy
with an edited report; `pytest repro/` in a fresh virtual environment that has llorch-ref and numpy but not
llama-cpp-python. Writes results/bundle/ (the screenshots and README.md with every command's output).

    python tools/bundle_evidence.py [--out results/bundle] [--work /tmp/bundle-evidence]
"""
from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path

from llorch_ref.harness.bundle import cpu_model
from llorch_ref.loaders.default_model import home
from llorch_ref.testing.browser import render
from llorch_ref.testing.plant import plant_scale

ROOT = Path(__file__).resolve().parents[1]


def sh(cmd, cwd=None, env=None) -> tuple[int, str, float]:
    t = time.perf_counter()
    r = subprocess.run(cmd, shell=True, cwd=cwd, capture_output=True, text=True, env=env)
    return r.returncode, (r.stdout + r.stderr).strip(), time.perf_counter() - t


def block(title, cmd, rc, out, secs, tail=25) -> list[str]:
    lines = [x for x in out.splitlines() if not x.startswith("WARNING: Location")]      # pip's mirror notices
    keep = lines if len(lines) <= tail else ["..."] + lines[-tail:]
    return [f"### {title}", "", f"`{cmd}` (exit {rc}, {secs:.1f} s)", "", "```", *keep, "```", ""]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "results" / "bundle"))
    ap.add_argument("--work", default="/tmp/bundle-evidence")
    a = ap.parse_args()
    out, work = Path(a.out), Path(a.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    out.mkdir(parents=True, exist_ok=True)
    models = home() / "models"
    f32, q41 = models / "SmolLM2-135M-Instruct.F32.gguf", models / "SmolLM2-135M-Instruct.Q4_1.gguf"
    planted = plant_scale(q41, work / "up11x1.05.gguf", "blk.11.ffn_up.weight", 1.05)
    md = ["# Reviewer bundles: report.html in a browser, verify, the repro without the subject engine", "",
          f"Machine: {cpu_model()}, 2 cores; {sh('chromium --version')[1].splitlines()[-1]}. Made by "
          f"`python tools/bundle_evidence.py`.", ""]
    cmds = [("A passing run (F32 copy of the default model, against llama.cpp)",
             f"llorch-ref prove --model {f32} --out {work} --run-id pass"),
            ("A llama.cpp dump of the planted copy (blk.11.ffn_up block scales x1.05)",
             f"llorch-ref dump --engine llamacpp --model {planted} --out {work}/planted.safetensors"),
            ("The planted dump against llorch-ref on the clean Q4_1 file",
             f"llorch-ref prove --subject {work}/planted.safetensors --model {q41} --out {work} --run-id planted"),
            ("Gemma 3 270M against llama.cpp: local (sliding-window) and global layers marked in the plots",
             f"llorch-ref prove --model gemma3-270m --out {work} --run-id gemma --no-tensors")]
    for title, cmd in cmds:
        md += block(title, cmd.replace(str(work), "$WORK").replace(str(home()), "$LLORCH_HOME"), *sh(cmd), tail=22)
    for run in ("pass", "planted", "gemma"):
        shot = out / f"report-{run}-first-screen.png"
        page = render(work / run / "report.html", screenshot=shot, size=(1280, 1400))
        render(work / run / "report.html", screenshot=out / f"report-{run}-full.png", size=(1280, 4400))
        md += [f"### report.html of `{run}` in headless Chromium", "",
               f"Console messages: {len(page['console'])} ({page['console'] or 'none'}); first screen "
               f"`{shot.name}`, the whole page `report-{run}-full.png`.", "", f"![{run}]({shot.name})", ""]
    md += block("verify on the untouched planted bundle (hashes, then the reference run again)",
                "llorch-ref verify $WORK/planted", *sh(f"llorch-ref verify {work}/planted"))
    edited = work / "planted-edited"
    shutil.copytree(work / "planted", edited)
    rep = edited / "cp6_swiglu" / "report.md"
    rep.write_text(rep.read_text().replace("**Verdict: FAIL**", "**Verdict: PASS**"))
    md += block("verify on a copy whose cp6 report was edited to say PASS",
                "llorch-ref verify $WORK/planted-edited", *sh(f"llorch-ref verify {edited}"))
    venv = work / "venv-no-engine"
    rc, text, secs = sh(f"{sys.executable} -m venv {venv} && {venv}/bin/pip install -q {ROOT} pytest")
    md += block("a fresh virtual environment: llorch-ref without extras, and pytest (no llama-cpp-python)",
                "python -m venv $WORK/venv-no-engine && $WORK/venv-no-engine/bin/pip install -q . pytest", rc, text,
                secs)
    md += block("llama_cpp is not importable there", "$WORK/venv-no-engine/bin/python -c 'import llama_cpp'",
                *sh(f"{venv}/bin/python -c 'import llama_cpp'"), tail=3)
    md += block("the repro of the planted bug, in that environment", "cd $WORK/planted && pytest -q repro/",
                *sh(f"{venv}/bin/python -m pytest -q -p no:cacheprovider repro/", cwd=work / "planted"), tail=12)
    (out / "README.md").write_text("\n".join(md) + "\n")
    print(f"wrote {out}/README.md")


if __name__ == "__main__":
    main()
