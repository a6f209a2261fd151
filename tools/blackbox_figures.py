"""Black-box figures (harness/blackbox.py): per-step KLD of clean engines against the reference, and the smallest
planted scale error caught through log-probabilities alone.

    python tools/blackbox_figures.py calibrate --out results/blackbox/clean [--write-bands]
    python tools/blackbox_figures.py sensitivity --out results/blackbox/planted

calibrate: llama-cpp-python's OpenAI server (default settings, --logits_all true; its top --top-k log-probabilities a
step) and mistral.rs (the whole vocabulary) on the default Q4_1 model, each prompt greedy for --steps steps, against
the reference in exact numerics and in ggml numerics (K/V float16, as both engines cache); --write-bands writes
checkpoints/blackbox_bands.json: kld 10 x the worst step, near_tie 2 x the widest margin of a flip (at least 0.05).
sensitivity: one matrix (--tensor) of the GGUF the engines run scaled by each --scales factor, the reference on the
clean file; a prompt counts as caught when its verdict is FAIL; the clean engines' FAILs are the false alarms.
Each writes OUT.json (first key made_by: command and commit) and OUT.md.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROMPTS = ["Once upon a time, there was a little",
           "The capital of France is Paris. The capital of Germany is",
           "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
           "In 1969, Apollo 11 landed on the Moon; 3.14159 is pi, and",
           "The recipe needs two cups of flour, one egg and",
           "Dear Sir or Madam, I am writing to",
           "The three primary colors are",
           "Water boils at 100 degrees Celsius, and ice"]


def made_by(argv) -> dict:
    """The command and commit a results file records."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    return {"command": "python tools/blackbox_figures.py " + " ".join(argv), "commit": commit.strip()}


def traces(subject: str, model, prompts, steps: int, top_k: int, tokenizer) -> list:
    """One Trace per prompt from `subject` (llama-cpp-python | mistralrs) running `model`."""
    from llorch_ref.references.blackbox import mistralrs_trace, openai_trace
    from llorch_ref.testing.openai_server import llama_cpp_server

    if subject == "mistralrs":
        return [mistralrs_trace(model, p, tokenizer, n_steps=steps) for p in prompts]
    with llama_cpp_server(model) as url:
        return [openai_trace(url, p, tokenizer, n_steps=steps, top_k=top_k) for p in prompts]


def judge_all(trs, references: dict, bands) -> dict:
    """numerics -> [{prompt, steps: [kld], flips: [margin], verdict}] of these traces against each reference."""
    from llorch_ref.harness.blackbox import compare_trace, steps_table

    out = {}
    for name, eng in references.items():
        rows = []
        for tr in trs:
            res = compare_trace(eng, tr, bands=bands)
            st = steps_table(res)
            v = res.verdict()
            rows.append({"prompt": tr.prompt, "steps": len(st), "kld": [s["kld"] for s in st],
                         "kld_kind": st[0]["kld_kind"], "flips": [s["margin"] for s in st if not s["same_top"]],
                         "verdict": v.status, "first_divergence": v.first_divergence})
        out[name] = rows
    return out


def references():
    import llorch_ref

    return {"exact": llorch_ref.load(), "ggml": llorch_ref.load(numerics="ggml", kv_dtype="float16")}


def open_bands() -> dict:
    """Bands that pass everything (the calibration judges nothing)."""
    return {"bands": {"exact:Q4_x": {"kld": 1e9, "near_tie": 1e9}, "ggml": {"kld": 1e9, "near_tie": 1e9}}}


def calibrate(a, argv):
    refs = references()
    tok = refs["exact"].tokenizer
    found = {"made_by": made_by(argv), "model": str(refs["exact"].path), "steps": a.steps, "prompts": a.prompts,
             "subjects": {}}
    for subject in a.subjects:
        t0 = time.perf_counter()
        trs = traces(subject, refs["exact"].path, PROMPTS[:a.prompts], a.steps, a.top_k, tok)
        found["subjects"][subject] = {"engine_s": time.perf_counter() - t0, "top_k": trs[0].top_k,
                                      "by_numerics": judge_all(trs, refs, open_bands())}
    bands = {}
    for numerics, key in (("exact", "exact:Q4_x"), ("ggml", "ggml")):
        runs = [r for s in found["subjects"].values() for r in s["by_numerics"][numerics]]
        worst = max(max(r["kld"]) for r in runs)
        flip = max((m for r in runs for m in r["flips"]), default=0.0)
        bands[key] = {"kld": float(f"{10 * worst:.2g}"), "near_tie": float(f"{max(2 * flip, 0.05):.2g}"),
                      "_measured": {"worst_kld": worst, "widest_flip_margin": flip, "runs": len(runs),
                                    "steps": sum(r["steps"] for r in runs)}}
    found["bands"] = bands
    write(a.out, found, calibrate_md(found))
    if a.write_bands:
        p = ROOT / "llorch_ref/checkpoints/blackbox_bands.json"
        p.write_text(json.dumps({
            "about": "Black-box bands (harness/blackbox.py) per arithmetic of the reference: kld, 10 x the worst "
                     "per-step KL(reference || engine) in nats measured on clean engines (llama-cpp-python's server "
                     "with default settings, its top-K log-probabilities: a lower bound; mistral.rs, the whole "
                     "vocabulary: exact), rounded to 2 digits; near_tie, 2 x the widest reference top-2 margin (nats) "
                     "at which a clean engine chose another token, at least 0.05.",
            "made_by": found["made_by"], "measured_in": f"{a.out}.md, {a.out}.json", "bands": bands}, indent=1) + "\n")


def calibrate_md(f) -> str:
    lines = ["# Black-box engines against the reference: per-step KLD on clean engines",
             "", f"`{f['made_by']['command']}` at commit {f['made_by']['commit']}; model {Path(f['model']).name}, "
             f"{f['prompts']} prompts x {f['steps']} greedy steps.", "",
             "| subject | log-probabilities | reference numerics | steps | median KLD | worst KLD | argmax flips "
             "(widest margin) | verdicts FAIL |", "|---|---|---|---|---|---|---|---|"]
    for s, d in f["subjects"].items():
        for n, runs in d["by_numerics"].items():
            k = sorted(x for r in runs for x in r["kld"])
            flips = [m for r in runs for m in r["flips"]]
            lines.append(f"| {s} | top {d['top_k']} ({runs[0]['kld_kind']}) | {n} | {len(k)} | {k[len(k) // 2]:.3g} | "
                         f"{k[-1]:.3g} | {len(flips)} ({max(flips, default=0):.3f}) | "
                         f"{sum(r['verdict'] == 'FAIL' for r in runs)} of {len(runs)} |")
    lines += ["", "Bands written (10 x the worst KLD; near_tie 2 x the widest flip margin, at least 0.05):", ""]
    lines += [f"- `{k}`: kld {v['kld']}, near_tie {v['near_tie']}" for k, v in f["bands"].items()]
    return "\n".join(lines) + "\n"


def sensitivity(a, argv):
    from llorch_ref.testing.plant import plant_scale

    refs = references()
    tok = refs["exact"].tokenizer
    found = {"made_by": made_by(argv), "model": str(refs["exact"].path), "tensor": a.tensor, "steps": a.steps,
             "prompts": a.prompts, "runs": {}}
    with tempfile.TemporaryDirectory() as d:
        for factor in [1.0] + a.scales:
            model = refs["exact"].path
            if factor != 1.0:
                model = plant_scale(model, Path(d) / f"planted-{factor}.gguf", a.tensor, factor)
            for subject in a.subjects:
                trs = traces(subject, model, PROMPTS[:a.prompts], a.steps, a.top_k, tok)
                found["runs"][f"{subject}@{factor}"] = judge_all(trs, refs, None)
                write(a.out, found, sensitivity_md(found))


def sensitivity_md(f) -> str:
    lines = ["# Black-box engines: a planted scale error caught through log-probabilities alone", "",
             f"`{f['made_by']['command']}` at commit {f['made_by']['commit']}; {Path(f['model']).name} with "
             f"`{f['tensor']}` scaled in the file the engine runs, the reference on the clean file; {f['prompts']} "
             f"prompts x {f['steps']} steps; a prompt is caught when its verdict is FAIL (scale 1.0: false alarms).",
             "", "| subject | scale | reference numerics | FAIL (prompts) | first divergence step (median) | worst KLD |",
             "|---|---|---|---|---|---|"]
    for key, by in f["runs"].items():
        subject, factor = key.split("@")
        for n, runs in by.items():
            steps = sorted(r["first_divergence"]["step"] for r in runs if r["first_divergence"])
            lines.append(f"| {subject} | {float(factor):.2f} | {n} | {sum(r['verdict'] == 'FAIL' for r in runs)} of "
                         f"{len(runs)} | {steps[len(steps) // 2] if steps else '-'} | "
                         f"{max(max(r['kld']) for r in runs):.3g} |")
    return "\n".join(lines) + "\n"


def write(out, found, md):
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(found, indent=1) + "\n")
    out.with_suffix(".md").write_text(md)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=["calibrate", "sensitivity"])
    ap.add_argument("--out", required=True)
    ap.add_argument("--subjects", nargs="+", default=["llama-cpp-python", "mistralrs"])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=100, help="log-probabilities a step asked of the OpenAI server")
    ap.add_argument("--tensor", default="blk.10.ffn_down.weight")
    ap.add_argument("--scales", type=float, nargs="+", default=[1.01, 1.02, 1.05, 1.10])
    ap.add_argument("--write-bands", action="store_true")
    a = ap.parse_args(argv)
    (calibrate if a.what == "calibrate" else sensitivity)(a, argv)


if __name__ == "__main__":
    main()
