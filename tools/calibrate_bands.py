"""Measure every checkpoint across several prompts and model copies, and write the bands into checkpoints/.

    python tools/calibrate_bands.py [--write] [--margin 10]
    python tools/calibrate_bands.py --blackbox [--write]     # checkpoints/blackbox_bands.json

--blackbox: the black-box bands per arithmetic and subject kind, from clean engines' log-probabilities
(tools/blackbox_figures.py calibrate: the runs it keeps in its cache are reused, their false alarms measured on
held-out prompts), written to results/blackbox/clean.{md,json}.

Each band class is measured on a copy of the default model with that weight type (see
tools/make_quant_copies.py). The band for NMSE is margin x the worst value measured; agreement bands
(argmax, greedy) are the worst measured fraction divided by 2 for quantized classes and exactly 1.0 for
F32/F16. The measured values are stored next to the bands, with this command.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

PROMPTS = [
    "Once upon a time, there was a little",
    "The capital of France is Paris. The capital of Germany is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "<|im_start|>user\nWhat is 17 * 23? Think step by step.<|im_end|>\n<|im_start|>assistant\n",
    "In 1969, Apollo 11 landed on the Moon; 3.14159 is pi, and 1,000,000 is a million. Über-naïve café ☕ 日本語",
]
CLASSES = {"F32": "f32", "F16": "f16", "Q8_0": "q8_0", "K": "q4_k_m", "Q4_x": None}   # None: the original
# storage classes: a copy loaded with --weight-dtype (dequantized weights stored reduced, math in float32)
STORAGE = {"BF16": ("f32", "bfloat16")}
EXACT = ("F32", "F16")      # classes whose argmax and greedy text must agree everywhere


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--write", action="store_true", help="write bands and measurements into checkpoints/*.json")
    ap.add_argument("--margin", type=float, default=10.0)
    ap.add_argument("--greedy", type=int, default=64)
    ap.add_argument("--classes", default=None,
                    help="comma list of band classes to measure (default: F32,F16,Q8_0,K,Q4_x); BF16 = the F32 "
                         "copy stored as bfloat16. Other classes' bands are kept.")
    ap.add_argument("--ggml", action="store_true",
                    help="measure numerics='ggml' (F32/F16 K/V) instead and write the 'ggml' band class")
    ap.add_argument("--blackbox", action="store_true",
                    help="the black-box bands (tools/blackbox_figures.py calibrate, 8 prompts x 64 steps)")
    a = ap.parse_args()
    if a.blackbox:
        return calibrate_blackbox(a)
    if a.ggml:
        return calibrate_ggml(a)
    sys.path.insert(0, str(Path(__file__).parent))
    from make_quant_copies import make_copies

    import llorch_ref
    from llorch_ref.checkpoints import load_specs
    from llorch_ref.harness.run import run_diff
    from llorch_ref.loaders.default_model import default_model_path, home

    orig = default_model_path()
    copies = make_copies(orig, home() / "models", ["f32", "f16", "q8_0", "q4_k_m"])
    specs = load_specs()
    measured = {s.id: {} for s in specs}
    want = a.classes.split(",") if a.classes else list(CLASSES)
    unknown = [c for c in want if c not in CLASSES and c not in STORAGE]
    if unknown:
        raise SystemExit(f"unknown class(es) {unknown}; known: {list(CLASSES) + list(STORAGE)}")
    for cls in want:
        key, store = STORAGE[cls] if cls in STORAGE else (CLASSES[cls], "float32")
        path = orig if key is None else copies[key]
        eng = llorch_ref.load(path, weight_dtype=store)
        worst = {}
        for p in PROMPTS:
            t0 = time.perf_counter()
            # band_class F32 only selects which (placeholder) band is printed; we read the raw figures
            r = run_diff(eng, prompt=p, n_greedy=a.greedy, band_class="F32")
            for s in r.summary():
                w = worst.setdefault(s["checkpoint"], {"nmse": 0.0, "max_abs": 0.0, "cosine": 1.0,
                                                        "agreement": 1.0})
                w["nmse"] = max(w["nmse"], s["worst_nmse"] or 0.0)
                w["max_abs"] = max(w["max_abs"], s["worst_max_abs"] or 0.0)
                w["cosine"] = min(w["cosine"], 1.0 if s["min_cosine"] is None else s["min_cosine"])
            for row in r.rows:
                if "agreement" in row.metrics:
                    w = worst[row.checkpoint]
                    w["agreement"] = min(w["agreement"], row.metrics["agreement"])
                if "equal_prefix" in row.metrics:
                    w = worst[row.checkpoint]
                    w["equal_prefix"] = min(w.get("equal_prefix", 10**9), row.metrics["equal_prefix"])
            print(f"{cls:5s} {time.perf_counter() - t0:5.1f}s {p[:40]!r}", file=sys.stderr)
        for cp, w in worst.items():
            measured[cp][cls] = {"worst_nmse": w["nmse"], "worst_max_abs": w["max_abs"], "min_cosine": w["cosine"],
                                 "min_agreement": w["agreement"], "model": path.name, "prompts": len(PROMPTS),
                                 **({"storage": f"{store} (--weight-dtype {store} on the {key.upper()} copy)"}
                                    if cls in STORAGE else {}),
                                 **({"min_equal_prefix": w["equal_prefix"]} if "equal_prefix" in w else {})}
            print(f"{cls:5s} cp{cp:3s} nmse {w['nmse']:.3e} max_abs {w['max_abs']:.3e} "
                  f"cos {w['cosine']:.9f} agree {w['agreement']:.3f}")
    if not a.write:
        return 0
    cmd = "python tools/calibrate_bands.py --write --margin %g --greedy %d" % (a.margin, a.greedy)
    if a.classes:
        cmd += f" --classes {a.classes}"
    for s in specs:
        d = json.loads(s.path.read_text())
        bands = {k: v for k, v in d["bands"].items() if k != "ggml"} if a.classes else {}
        for cls, m in measured[s.id].items():
            if s.id in ("0",):
                bands[cls] = {"agreement": 1.0}
            elif s.id == "10":
                exact = cls in EXACT
                bands[cls] = {"agreement": 1.0 if exact else math.floor(m["min_agreement"] / 2 * 100) / 100}
            elif s.id == "12":
                # exact classes: every token equal; quantized ones: half the shortest equal prefix measured
                exact = cls in EXACT
                bands[cls] = ({"agreement": 1.0} if exact else
                              {"equal_prefix": int(m["min_equal_prefix"] // 2)})
            else:
                nm = m["worst_nmse"]
                bands[cls] = {"nmse": float(f"{max(nm, 1e-15) * a.margin:.1e}")}
        keep_ggml = {k: d.get(k, {}).get("ggml") for k in ("bands", "measured")}    # set by --ggml, kept
        d["bands"] = bands
        by_class = {**(d.get("measured", {}).get("by_class", {}) if a.classes else {}), **measured[s.id]}
        old_cmd = d.get("measured", {}).get("command")
        d["measured"] = {"command": cmd if not a.classes or not old_cmd else f"{old_cmd}; then {cmd}",
                         "margin": a.margin, "prompts": PROMPTS, "greedy_tokens": a.greedy, "by_class": by_class}
        for k, v in keep_ggml.items():
            if v is not None:
                d[k]["ggml"] = v
        s.path.write_text(json.dumps(d, indent=2) + "\n")
    print("bands written to", specs[0].path.parent, file=sys.stderr)
    return 0


def calibrate_blackbox(a):
    """The black-box bands: tools/blackbox_figures.py calibrate, its per-step band a.margin x the worst clean step."""
    sys.path.insert(0, str(Path(__file__).parent))
    import blackbox_figures

    argv = ["calibrate", "--out", "results/blackbox/clean", "--prompts", "8", "--steps", "64",
            "--margin", f"{a.margin:g}"] + (["--write-bands"] if a.write else [])
    blackbox_figures.main(argv)


def calibrate_ggml(a):
    """numerics='ggml' reproduces llama.cpp's arithmetic: the band is bit-identity (max abs 0) when every
    measurement is 0, else margin x the worst NMSE measured (reported loudly)."""
    sys.path.insert(0, str(Path(__file__).parent))
    from make_quant_copies import make_copies

    import llorch_ref
    from llorch_ref.checkpoints import load_specs
    from llorch_ref.harness.run import run_diff
    from llorch_ref.loaders.default_model import default_model_path, home

    orig = default_model_path()
    copies = make_copies(orig, home() / "models", ["f32", "f16", "q8_0"])
    specs = load_specs()
    worst = {s.id: {"max_abs": 0.0, "nmse": 0.0, "min_agreement": 1.0, "runs": 0} for s in specs}
    models = {"F32": copies["f32"], "F16": copies["f16"], "Q8_0": copies["q8_0"], "Q4_1": orig}
    for cls, path in models.items():
        for kv in ("f32", "f16"):
            eng = llorch_ref.load(path, numerics="ggml", kv_dtype=kv)
            for p in PROMPTS:
                t0 = time.perf_counter()
                r = run_diff(eng, prompt=p, n_greedy=a.greedy)
                for row in r.rows:
                    w = worst[row.checkpoint]
                    w["runs"] += 1
                    w["max_abs"] = max(w["max_abs"], row.metrics.get("max_abs", 0.0))
                    w["nmse"] = max(w["nmse"], row.metrics.get("nmse", 0.0))
                    w["min_agreement"] = min(w["min_agreement"], row.metrics.get("agreement", 1.0))
                print(f"ggml {cls} {kv} {time.perf_counter() - t0:5.1f}s {p[:40]!r} "
                      f"first divergence {r.first_divergence}", file=sys.stderr)
    cmd = "python tools/calibrate_bands.py --ggml --write --greedy %d" % a.greedy
    for s in specs:
        w = worst[s.id]
        print(f"ggml cp{s.id:3s} worst max_abs {w['max_abs']:.3e} nmse {w['nmse']:.3e} "
              f"min agreement {w['min_agreement']:.3f} over {w['runs']} comparisons")
        if not a.write:
            continue
        d = json.loads(s.path.read_text())
        if s.id in ("0", "10", "12"):
            d["bands"]["ggml"] = {"agreement": 1.0}
        elif w["max_abs"] == 0.0:
            d["bands"]["ggml"] = {"max_abs": 0.0}
        else:
            d["bands"]["ggml"] = {"nmse": float(f"{w['nmse'] * a.margin:.1e}")}
        d.setdefault("measured", {})["ggml"] = {
            "command": cmd, "models": [p.name for p in models.values()], "kv_dtypes": ["f32", "f16"],
            "prompts": len(PROMPTS), "worst_max_abs": w["max_abs"], "worst_nmse": w["nmse"],
            "min_agreement": w["min_agreement"], "comparisons": w["runs"]}
        s.path.write_text(json.dumps(d, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
