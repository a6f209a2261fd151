"""Black-box figures (harness/blackbox.py): per-step and run-level figures of clean engines against the reference,
the bands they set, their false alarms on held-out prompts, and the smallest planted scale error caught through
log-probabilities alone.

    python tools/blackbox_figures.py collect [--sets calibration held-out planted] [--numerics exact ggml]
    python tools/blackbox_figures.py calibrate --out results/blackbox/clean [--write-bands]
    python tools/blackbox_figures.py sensitivity --out results/blackbox/planted

collect: runs the engines (llama-cpp-python's OpenAI server with default settings, --logits_all true, its top
--top-k log-probabilities a step; mistral.rs, the whole vocabulary) on the default Q4_1 model, each prompt greedy for
--steps steps, and the reference teacher-forced on their tokens in each --numerics (exact; ggml: llama.cpp's
arithmetic, K/V float16); engine traces and the reference's per-step figures are kept in the cache
($LLORCH_BLACKBOX_CACHE, default ~/.cache/llorch_ref/blackbox), so each statistic reads them without a rerun.
calibrate: the bands from the --prompts calibration prompts (per step: --margin x the worst step; run-level, per
subject kind: --run-margin x the worst run's mean KLD and mean log-probability shift), their false alarms on the
--held-out prompts; --write-bands writes checkpoints/blackbox_bands.json.
sensitivity: one matrix (--tensor) of the GGUF the engines run scaled by each --scales factor, the reference on the
clean file, on the held-out prompts under the shipped bands; a run counts as caught when its verdict is FAIL.
Each writes OUT.json (first key made_by: command and commit) and OUT.md.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
from made_at import commit

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
    return {"command": "python tools/blackbox_figures.py " + " ".join(argv), "commit": commit()}


HELD_OUT = ["The old lighthouse keeper climbed the stairs and",
            "To install the package, open a terminal and type",
            "My favourite season is autumn because the leaves",
            "The train to London leaves at nine o'clock, so we",
            "for i in range(10):\n    print(",
            "The human heart has four chambers: two atria and",
            "She opened the letter, read the first line, and",
            "Photosynthesis turns sunlight, water and carbon dioxide into"]
CACHE = Path(os.environ.get("LLORCH_BLACKBOX_CACHE", Path.home() / ".cache/llorch_ref/blackbox"))


def cache_name(subject: str, label: str, prompt: str, steps: int, top_k: int) -> str:
    """The file stem of one engine run in the cache: subject, model label (clean | TENSOR@FACTOR), prompt, steps, K."""
    key = json.dumps([subject, label, prompt, steps, top_k if subject != "mistralrs" else "all"])
    return f"{subject}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def save_trace(path: Path, tr) -> None:
    """A Trace as npz: ids and log-probabilities of every step's entries (float64, concatenated) and its fields."""
    counts = np.array([len(s.top) for s in tr.steps], dtype=np.int64)
    ids = np.concatenate([np.fromiter(s.top.keys(), np.int64, len(s.top)) for s in tr.steps])
    vals = np.concatenate([np.fromiter(s.top.values(), np.float64, len(s.top)) for s in tr.steps])
    meta = {k: getattr(tr, k) for k in ("engine", "version", "prompt", "top_k", "whole", "prompt_ids", "tokenized_by",
                                         "completion_text", "settings", "chat", "stop_reason")}
    meta["steps"] = [{"token": s.token, "logprob": s.logprob, "ambiguous": s.ambiguous, "text": s.text,
                      "shared": s.shared} for s in tr.steps]
    np.savez_compressed(path, counts=counts, ids=ids, vals=vals, meta=np.array(json.dumps(meta)))


def load_trace(path: Path):
    from llorch_ref.references.blackbox import Step, Trace

    z = np.load(path)
    meta = json.loads(str(z["meta"]))
    ends = np.cumsum(z["counts"])
    ids, vals = z["ids"], z["vals"]
    steps = [Step(top=dict(zip(ids[e - c:e].tolist(), vals[e - c:e].tolist())), **st)
             for st, c, e in zip(meta.pop("steps"), z["counts"], ends)]
    return Trace(steps=steps, **meta)


def collect(subject: str, label: str, model, prompts, steps: int, top_k: int, refs: dict, log=print,
            cached=False) -> list:
    """Per prompt: {numerics: steps_table rows + cp0} of `subject` running `model` against each reference, from the
    cache where there (engine traces and reference figures both kept), else run and kept. cached: nothing is run;
    only the prompts and numerics the cache holds."""
    if cached:
        names = [cache_name(subject, label, p, steps, top_k) for p in prompts]
        got = [{num: json.loads((CACHE / f"{n}.{num}.json").read_text()) for num in refs
                if (CACHE / f"{n}.{num}.json").exists()} for n in names]
        return [g for g in got if g]
    from llorch_ref.errors import BlackBoxError
    from llorch_ref.harness.blackbox import compare_trace, steps_table
    from llorch_ref.references.blackbox import mistralrs_trace, openai_trace
    from llorch_ref.testing.openai_server import llama_cpp_server

    CACHE.mkdir(parents=True, exist_ok=True)
    tok = refs["exact"].tokenizer
    names = [cache_name(subject, label, p, steps, top_k) for p in prompts]
    todo = [(p, n) for p, n in zip(prompts, names)
            if not all((CACHE / f"{n}.{num}.json").exists() for num in refs)]
    missing = [(p, n) for p, n in todo if not (CACHE / f"{n}.npz").exists()]
    if missing:
        log(f"running {subject} on {label}: {len(missing)} prompts x {steps} steps")
        t0 = time.perf_counter()
        if subject == "mistralrs":
            for p, n in missing:
                save_trace(CACHE / f"{n}.npz", mistralrs_trace(model, p, tok, n_steps=steps))
        else:
            with llama_cpp_server(model) as url:
                for p, n in missing:
                    save_trace(CACHE / f"{n}.npz", openai_trace(url, p, tok, n_steps=steps, top_k=top_k))
        log(f"  {time.perf_counter() - t0:.0f} s")
    for p, n in todo:
        tr = load_trace(CACHE / f"{n}.npz")
        for num, eng in refs.items():
            out = CACHE / f"{n}.{num}.json"
            if out.exists():
                continue
            t0 = time.perf_counter()
            head = {"prompt": p, "subject": subject, "label": label, "numerics": num, "top_k": tr.top_k,
                    "whole": tr.whole}
            try:
                res = compare_trace(eng, tr, bands=open_bands())
            except BlackBoxError as e:           # kept as the run's figure: an engine answer that cannot be compared
                out.write_text(json.dumps({**head, "error": str(e), "steps": []}))
                continue
            cp0 = next(r for r in res.rows if r.checkpoint == "0")
            out.write_text(json.dumps({**head, "cp0": not cp0.diverges, "reference_s": time.perf_counter() - t0,
                                       "steps": steps_table(res)}))
            log(f"  reference {num} on {label} {p[:30]!r}: {time.perf_counter() - t0:.0f} s")
    return [{num: json.loads((CACHE / f"{n}.{num}.json").read_text()) for num in refs} for n in names]


def references(numerics=("exact", "ggml")) -> dict:
    """The reference in each numerics: exact (float32) and ggml (llama.cpp's arithmetic, K/V float16)."""
    import llorch_ref

    made = {"exact": lambda: llorch_ref.load(), "ggml": lambda: llorch_ref.load(numerics="ggml", kv_dtype="float16")}
    return {n: made[n]() for n in numerics}


def model_for(label: str, clean: Path) -> Path:
    """The file a label names: 'clean', else TENSOR@FACTOR, planted into a copy kept in the cache."""
    from llorch_ref.testing.plant import plant_scale

    if label == "clean":
        return clean
    tensor, factor = label.split("@")
    out = CACHE / f"planted-{tensor}-{factor}.gguf"
    if not out.exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        plant_scale(clean, out, tensor, float(factor))
    return out


def run_collect(a, argv):
    """Fill the cache: the clean engines on the calibration and held-out prompts, then the planted files on the
    held-out prompts (only the numerics asked), one engine run at a time."""
    refs = references(a.numerics)
    clean = refs[a.numerics[0]].path
    sets = {"calibration": PROMPTS[:a.prompts], "held-out": HELD_OUT[:a.held_out]}
    for subject in a.subjects:
        for which in a.sets:
            if which == "planted":
                for factor in a.scales:
                    label = f"{a.tensor}@{factor}"
                    collect(subject, label, model_for(label, clean), sets["held-out"], a.steps, a.top_k, refs)
            else:
                collect(subject, "clean", clean, sets[which], a.steps, a.top_k, refs)


def open_bands() -> dict:
    """Bands that pass everything (the calibration judges nothing)."""
    return {"bands": {"exact:Q4_x": {"kld": 1e9, "near_tie": 1e9}, "ggml": {"kld": 1e9, "near_tie": 1e9}}}


KIND = {"llama-cpp-python": "openai", "mistralrs": "mistral.rs"}     # the subject kind a trace names its engine
KEYS = {"exact": "exact:Q4_x", "ggml": "ggml"}                      # the band each reference numerics is judged under


def figures(rec: dict, window: int) -> dict:
    """A cached run's figures: steps, worst and median step KLD, the run-level statistics over the whole run and
    over its first `window` steps (the shortest run the run-level band judges), the margins of its flips."""
    from llorch_ref.harness.blackbox import run_statistics

    st = rec["steps"]
    if not st:
        return {"error": rec.get("error"), "steps": 0}
    k = sorted(s["kld"] for s in st)

    def stats(rows):
        return run_statistics([s["kld"] for s in rows], [s["ref_logprob"] for s in rows],
                              [s["engine_logprob"] for s in rows])
    whole, head = stats(st), stats(st[:window])
    return {"steps": len(st), "max_kld": k[-1], "median_kld": k[len(k) // 2], "mean_kld": whole["mean_kld"],
            "mean_shift": whole["mean_shift"], "window_mean_kld": head["mean_kld"],
            "window_shift": head["logprob_shift"], "flips": [s["margin"] for s in st if not s["same_top"]],
            "cp0": rec.get("cp0")}


def make_bands(cal: dict, margin_step: float, margin_run: float, window: int) -> dict:
    """Bands from the calibration runs {subject: {numerics: [figures]}}: per arithmetic, kld margin_step x the worst
    step of any subject, near_tie 2 x the widest flip margin (at least 0.05); per subject kind under it, mean_kld
    and logprob_shift margin_run x the worst run (over the whole run and its first `window` steps)."""
    def sig2(x):
        return float(f"{x:.2g}")
    out = {}
    for num, key in KEYS.items():
        runs = [f for by in cal.values() for f in by.get(num, []) if f["steps"]]
        if not runs:
            continue
        worst = max(f["max_kld"] for f in runs)
        flip = max((m for f in runs for m in f["flips"]), default=0.0)
        run = {}
        for subject, by in cal.items():
            rs = [f for f in by.get(num, []) if f["steps"] >= window]
            if rs:
                wk = max(max(f["mean_kld"], f["window_mean_kld"]) for f in rs)
                ws = max(max(abs(f["mean_shift"]), f["window_shift"]) for f in rs)
                run[KIND[subject]] = {"mean_kld": sig2(margin_run * wk), "logprob_shift": sig2(margin_run * ws),
                                      "min_steps": window, "_measured": {"worst_mean_kld": wk, "worst_shift": ws,
                                                                         "runs": len(rs)}}
        out[key] = {"kld": sig2(margin_step * worst), "near_tie": sig2(max(2 * flip, 0.05)), "run": run,
                    "_measured": {"worst_kld": worst, "widest_flip_margin": flip, "runs": len(runs),
                                  "steps": sum(f["steps"] for f in runs)}}
    return out


def judge(rec: dict, bands: dict, subject: str) -> dict:
    """A cached run under the bands, by the verdict's rule (harness/blackbox.py: judge_table)."""
    from llorch_ref.harness.blackbox import judge_table, run_band_for

    if not rec["steps"]:
        return {"status": "ERROR", "by": rec.get("error")}
    band = bands[KEYS[rec["numerics"]]]
    j = judge_table(rec["steps"], band, run_band_for(band, KIND[subject]))
    status = "FAIL" if (j["step"] is not None or not rec.get("cp0", True)) else "PASS"
    return {"status": status, "by": j["by"] if rec.get("cp0", True) else "cp0", "step": j["step"],
            "run_failed": j["run_failed"], "mean_kld": j["stats"]["mean_kld"], "shift": j["stats"]["mean_shift"]}


def gather(a, sets=("calibration", "held-out")) -> dict:
    """{set: {subject: {numerics: [cached run]}}}, running what the cache lacks."""
    refs = references(a.numerics)
    clean = refs[a.numerics[0]].path
    prompts = {"calibration": PROMPTS[:a.prompts], "held-out": HELD_OUT[:a.held_out]}
    out = {"model": str(clean)}
    for which in sets:
        for subject in a.subjects:
            recs = collect(subject, "clean", clean, prompts[which], a.steps, a.top_k, refs, cached=a.cached)
            out.setdefault(which, {})[subject] = {n: [r[n] for r in recs if n in r] for n in a.numerics
                                                  if any(n in r for r in recs)}
    return out


def calibrate(a, argv):
    from llorch_ref.backends import cpu_model

    runs = gather(a)
    cal = {s: {n: [figures(r, a.window) for r in rs] for n, rs in by.items()} for s, by in runs["calibration"].items()}
    bands = make_bands(cal, a.margin, a.run_margin, a.window)
    held = {s: {n: [judge(r, {"bands": bands}["bands"], s) for r in rs] for n, rs in by.items()}
            for s, by in runs["held-out"].items()}
    held_fig = {s: {n: [figures(r, a.window) for r in rs] for n, rs in by.items()}
                for s, by in runs["held-out"].items()}
    found = {"made_by": made_by(argv), "cpu": cpu_model(), "model": runs["model"],
             "steps": a.steps, "prompts": PROMPTS[:a.prompts], "held_out_prompts": HELD_OUT[:a.held_out],
             "top_k": a.top_k, "margin_step": a.margin, "margin_run": a.run_margin, "window": a.window,
             "calibration": cal, "held_out": held_fig, "false_alarms": held, "bands": bands}
    write(a.out, found, calibrate_md(found))
    if a.write_bands:
        p = ROOT / "llorch_ref/checkpoints/blackbox_bands.json"
        p.write_text(json.dumps({
            "about": "Black-box bands (harness/blackbox.py) per arithmetic of the reference: kld, "
                     f"{a.margin:g} x the worst per-step KL(reference || engine) in nats measured on clean engines "
                     "(llama-cpp-python's server with default settings, its top-K log-probabilities: a lower bound; "
                     "mistral.rs, the whole vocabulary: exact); near_tie, 2 x the widest reference top-2 margin "
                     "(nats) at which a clean engine chose another token, at least 0.05; run, per subject kind "
                     f"(openai, mistral.rs): mean_kld and logprob_shift, {a.run_margin:g} x the worst clean run's mean "
                     "KLD and |mean shift| of the engine's token's log-probability (over the whole run and its "
                     f"first {a.window} steps), judged on runs of at least min_steps steps. Rounded to 2 digits.",
            "made_by": found["made_by"], "measured_in": f"{a.out}.md, {a.out}.json", "bands": bands}, indent=1) + "\n")


def calibrate_md(f) -> str:
    lines = ["# Black-box engines against the reference: per-step KLD on clean engines", "",
             f"`{f['made_by']['command']}` at commit {f['made_by']['commit']}; CPU {f['cpu']}; model "
             f"{Path(f['model']).name}; {len(f['prompts'])} calibration prompts and {len(f['held_out_prompts'])} "
             f"held-out prompts (false alarms) x up to {f['steps']} greedy steps (a run ends early at the end of "
             f"generation); llama-cpp-python: its top {f['top_k']} log-probabilities a step (a KLD lower bound), "
             "mistral.rs: the whole vocabulary (exact).", "",
             "## Calibration prompts", "",
             "| subject | reference numerics | runs | steps | median step KLD | worst step KLD | mean KLD (runs: "
             "median, worst) | mean log-prob shift engine - ref (worst size) | argmax flips (widest margin) |",
             "|---|---|---|---|---|---|---|---|---|"]

    def row(s, n, fs):
        fs = [x for x in fs if x["steps"]]
        k = sorted(x["median_kld"] for x in fs)
        mk = sorted(x["mean_kld"] for x in fs)
        fl = [m for x in fs for m in x["flips"]]
        return (f"| {s} | {n} | {len(fs)} | {sum(x['steps'] for x in fs)} | {k[len(k) // 2]:.3g} | "
                f"{max(x['max_kld'] for x in fs):.3g} | {mk[len(mk) // 2]:.3g}, {mk[-1]:.3g} | "
                f"{max(abs(x['mean_shift']) for x in fs):.3g} | {len(fl)} ({max(fl, default=0):.3f}) |")
    for s, by in f["calibration"].items():
        for n, fs in by.items():
            lines.append(row(s, n, fs))
    lines += ["", "## Held-out prompts: the same figures, and the bands' false alarms", "",
              "| subject | reference numerics | runs | steps | median step KLD | worst step KLD | mean KLD (runs: "
              "median, worst) | mean log-prob shift engine - ref (worst size) | argmax flips (widest margin) |",
              "|---|---|---|---|---|---|---|---|---|"]
    for s, by in f["held_out"].items():
        for n, fs in by.items():
            lines.append(row(s, n, fs))
    lines += ["", "| subject | reference numerics | false alarms (FAIL of held-out runs) | by |", "|---|---|---|---|"]
    for s, by in f["false_alarms"].items():
        for n, js in by.items():
            bad = [j for j in js if j["status"] != "PASS"]
            lines.append(f"| {s} | {n} | {len(bad)} of {len(js)} | {', '.join(str(j['by']) for j in bad) or '-'} |")
    lines += ["", f"Bands (per step: {f['margin_step']:g} x the worst step, near_tie 2 x the widest flip margin; "
              f"run: {f['margin_run']:g} x the worst run's mean, judged on runs of at least {f['window']} steps):", ""]
    for k, v in f["bands"].items():
        lines.append(f"- `{k}`: kld {v['kld']}, near_tie {v['near_tie']}; run: " + "; ".join(
            f"{kind} mean_kld {r['mean_kld']}, logprob_shift {r['logprob_shift']}" for kind, r in v["run"].items()))
    return "\n".join(lines) + "\n"


def sensitivity(a, argv):
    """The planted files on the held-out prompts under the shipped bands: per scale, the runs caught, and by what."""
    from llorch_ref.backends import cpu_model
    from llorch_ref.harness.blackbox import load_bands

    bands = load_bands()["bands"]
    refs = references(a.numerics)
    clean = refs[a.numerics[0]].path
    prompts = HELD_OUT[:a.held_out]
    found = {"made_by": made_by(argv), "cpu": cpu_model(), "model": str(clean), "tensor": a.tensor, "steps": a.steps,
             "prompts": prompts, "window": a.window, "bands_from": load_bands()["made_by"], "runs": {}}
    for subject in a.subjects:
        for factor in [1.0] + a.scales:
            label = "clean" if factor == 1.0 else f"{a.tensor}@{factor}"
            model = clean if a.cached else model_for(label, clean)
            recs = collect(subject, label, model, prompts, a.steps, a.top_k, refs, cached=a.cached)
            found["runs"][f"{subject}@{factor}"] = {n: [{**judge(r[n], bands, subject), **figures(r[n], a.window)}
                                                        for r in recs if n in r] for n in a.numerics}
            write(a.out, found, sensitivity_md(found))


def sensitivity_md(f) -> str:
    lines = ["# Black-box engines: a planted scale error caught through log-probabilities alone", "",
             f"`{f['made_by']['command']}` at commit {f['made_by']['commit']}; CPU {f['cpu']}; "
             f"{Path(f['model']).name} with `{f['tensor']}` scaled in the file the engine runs, the reference on the "
             f"clean file; {len(f['prompts'])} held-out prompts (none used to set the bands) x up to {f['steps']} "
             f"greedy steps; bands of checkpoints/blackbox_bands.json (commit {f['bands_from']['commit']}). A run is "
             "caught when its verdict is FAIL; scale 1.00 is the clean engine (its FAILs are false alarms). "
             "'per step': a step's KLD or a flip outside the near-tie band; 'run': only the run-level row (mean KLD, "
             "mean log-probability shift).", "",
             f"A run shorter than {f['window']} steps (the engine ended its generation) is judged per step only.", "",
             "| subject | scale | reference numerics | caught (runs) | runs of 32+ steps | by per step | by run only | "
             "mean KLD (median run) | mean shift (median run) | worst step KLD |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for key, by in f["runs"].items():
        subject, factor = key.split("@")
        for n, rs in by.items():
            ok = [r for r in rs if r["steps"]]
            if not ok:
                continue
            mk = sorted(r["mean_kld"] for r in ok)
            sh = sorted(r["mean_shift"] for r in ok)
            lines.append(f"| {subject} | {float(factor):.2f} | {n} | {sum(r['status'] == 'FAIL' for r in rs)} of "
                         f"{len(rs)} | {sum(r['steps'] >= f['window'] for r in rs)} | "
                         f"{sum(r['by'] in ('kld', 'argmax') for r in rs)} | "
                         f"{sum(r['by'] == 'run' for r in rs)} | {mk[len(mk) // 2]:.3g} | {sh[len(sh) // 2]:+.3g} | "
                         f"{max(r['max_kld'] for r in ok):.3g} |")
    return "\n".join(lines) + "\n"


def write(out, found, md):
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(found, indent=1) + "\n")
    out.with_suffix(".md").write_text(md)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=["collect", "calibrate", "sensitivity"])
    ap.add_argument("--out")
    ap.add_argument("--sets", nargs="+", default=["calibration", "held-out", "planted"],
                    help="collect: which runs (calibration, held-out: clean engines; planted: each --scales)")
    ap.add_argument("--numerics", nargs="+", default=["exact", "ggml"], help="collect: the reference's numerics")
    ap.add_argument("--held-out", type=int, default=4, help="held-out prompts (false alarms, planted files)")
    ap.add_argument("--subjects", nargs="+", default=["llama-cpp-python", "mistralrs"])
    ap.add_argument("--prompts", type=int, default=8, help="calibration prompts")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=100, help="log-probabilities a step asked of the OpenAI server")
    ap.add_argument("--tensor", default="blk.29.ffn_down.weight",
                    help="the matrix planted (the last layer's down projection, the most sensitive probed)")
    ap.add_argument("--scales", type=float, nargs="+", default=[1.01, 1.02, 1.05, 1.10])
    ap.add_argument("--write-bands", action="store_true")
    ap.add_argument("--cached", action="store_true", help="calibrate, sensitivity: run nothing, read the cache's runs")
    ap.add_argument("--margin", type=float, default=10.0, help="calibrate: per-step band, x the worst clean step")
    ap.add_argument("--run-margin", type=float, default=2.0, help="calibrate: run-level bands, x the worst clean run")
    ap.add_argument("--window", type=int, default=32, help="calibrate: the shortest run the run-level band judges")
    a = ap.parse_args(argv)
    {"collect": run_collect, "calibrate": calibrate, "sensitivity": sensitivity}[a.what](a, argv)


if __name__ == "__main__":
    main()
