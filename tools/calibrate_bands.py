"""Measure every checkpoint across several prompts and model copies, and write the bands into checkpoints/.

    python tools/calibrate_bands.py [--write] [--margin 10]

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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--write", action="store_true", help="write bands and measurements into checkpoints/*.json")
    ap.add_argument("--margin", type=float, default=10.0)
    ap.add_argument("--greedy", type=int, default=64)
    a = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).parent))
    import llorch_ref
    from llorch_ref.harness.run import run_diff
    from llorch_ref.harness.specs import load_specs
    from llorch_ref.loaders.default_model import default_model_path, home
    from make_quant_copies import make_copies

    orig = default_model_path()
    copies = make_copies(orig, home() / "models", ["f32", "f16", "q8_0", "q4_k_m"])
    specs = load_specs()
    measured = {s.id: {} for s in specs}
    for cls, key in CLASSES.items():
        path = orig if key is None else copies[key]
        eng = llorch_ref.load(path)
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
                                 **({"min_equal_prefix": w["equal_prefix"]} if "equal_prefix" in w else {})}
            print(f"{cls:5s} cp{cp:3s} nmse {w['nmse']:.3e} max_abs {w['max_abs']:.3e} "
                  f"cos {w['cosine']:.9f} agree {w['agreement']:.3f}")
    if not a.write:
        return 0
    cmd = "python tools/calibrate_bands.py --write --margin %g --greedy %d" % (a.margin, a.greedy)
    for s in specs:
        d = json.loads(s.path.read_text())
        bands = {}
        for cls, m in measured[s.id].items():
            if s.id in ("0",):
                bands[cls] = {"agreement": 1.0}
            elif s.id == "10":
                exact = cls in ("F32", "F16")
                bands[cls] = {"agreement": 1.0 if exact else math.floor(m["min_agreement"] / 2 * 100) / 100}
            elif s.id == "12":
                # exact classes: every token equal; quantized ones: half the shortest equal prefix measured
                exact = cls in ("F32", "F16")
                bands[cls] = ({"agreement": 1.0} if exact else
                              {"equal_prefix": int(m["min_equal_prefix"] // 2)})
            else:
                nm = m["worst_nmse"]
                bands[cls] = {"nmse": float(f"{max(nm, 1e-15) * a.margin:.1e}")}
        d["bands"] = bands
        d["measured"] = {"command": cmd, "margin": a.margin, "prompts": PROMPTS, "greedy_tokens": a.greedy,
                         "by_class": measured[s.id]}
        s.path.write_text(json.dumps(d, indent=2) + "\n")
    print("bands written to", specs[0].path.parent, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
