"""Measure every checkpoint across several prompts and model copies, and write the bands into checkpoints/.

    python tools/calibrate_bands.py [--write] [--margin 10]
    python tools/calibrate_bands.py --blackbox [--write]     # checkpoints/blackbox_bands.json
    python tools/calibrate_bands.py --gpu-layers 99 --save-measurements M.json     # on a GPU host
    python tools/calibrate_bands.py --from-measurements M.json --write            # the '+cuda' bands, here
    python tools/calibrate_bands.py --held-out [--gpu-layers 99 | --from-measurements H.json]   # false alarms

--gpu-layers: llama.cpp (a llama-cpp-python built with its CUDA backend) runs the layers on the GPU; the bands are
the classes' "+cuda" ones. --held-out: other prompts (HELD_OUT), nothing written: every comparison outside the
bands in the checkout is a false alarm, counted per class.

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
import gzip
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
# the '+cuda' bands are measured on these too: llama.cpp's CUDA sums differ from the reference's more from prompt to
# prompt than its CPU sums do (on 5 prompts, margin 10 left false alarms on 8 others)
EXTRA = [
    "The quick brown fox jumps over the lazy dog. Then the dog",
    "Water boils at 100 degrees Celsius because",
    "<|im_start|>user\nWrite a haiku about autumn.<|im_end|>\n<|im_start|>assistant\n",
    "import numpy as np\nx = np.arange(10)\nprint(",
    "Les enfants jouent dans le jardin et",
    "Step 1: preheat the oven to 180C. Step 2:",
    "The mitochondria is the powerhouse of",
    "Q: What is the tallest mountain on Earth?\nA:",
]
HELD_OUT = [                # measured against the bands, never used to make them
    "My grandmother's recipe for apple pie starts with",
    "SELECT name, age FROM users WHERE",
    "<|im_start|>user\nTranslate 'good morning' into Spanish.<|im_end|>\n<|im_start|>assistant\n",
    "The three primary colors are red,",
    "Once the rain stopped, the children ran outside and",
    "for (int i = 0; i < n; ++i) {\n    sum +=",
    "Photosynthesis converts sunlight, water and carbon dioxide into",
    "Dear hiring manager, I am writing to apply for",
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
    ap.add_argument("--gpu-layers", type=int, default=0,
                    help="llama.cpp runs this many layers on its GPU backend (99: all): the classes' '+cuda' bands")
    ap.add_argument("--save-measurements", type=Path, default=None,
                    help="also write every comparison measured to this JSON file (measure where the GPU is)")
    ap.add_argument("--from-measurements", type=Path, default=None,
                    help="take the comparisons from such a file instead of running them (write the bands here)")
    ap.add_argument("--held-out", action="store_true",
                    help="the HELD_OUT prompts against the bands as they are: false alarms counted, nothing written")
    ap.add_argument("--ggml", action="store_true",
                    help="measure numerics='ggml' (F32/F16 K/V) instead and write the 'ggml' band class")
    ap.add_argument("--blackbox", action="store_true",
                    help="the black-box bands (tools/blackbox_figures.py calibrate, 8 prompts x 64 steps)")
    a = ap.parse_args()
    if a.blackbox:
        return calibrate_blackbox(a)
    if a.ggml:
        return calibrate_ggml(a)
    from llorch_ref.checkpoints import GPU, load_specs

    want = a.classes.split(",") if a.classes else list(CLASSES)
    unknown = [c for c in want if c not in CLASSES and c not in STORAGE]
    if unknown:
        raise SystemExit(f"unknown class(es) {unknown}; known: {list(CLASSES) + list(STORAGE)}")
    prompts = HELD_OUT if a.held_out else PROMPTS + EXTRA if a.gpu_layers else PROMPTS
    if a.from_measurements:
        saved = json.loads(read_text(a.from_measurements))
        runs, a.gpu_layers, a.greedy, prompts = saved["runs"], saved["gpu_layers"], saved["greedy"], saved["prompts"]
    else:
        runs = measure(want, a.greedy, a.gpu_layers, prompts)
    if a.save_measurements:
        write_text(a.save_measurements, json.dumps({"command": command(a, saved=False), "gpu_layers": a.gpu_layers,
                                                    "greedy": a.greedy, "prompts": prompts, "runs": runs}) + "\n")
    suffix = GPU if a.gpu_layers else ""
    specs = load_specs()
    if a.held_out:
        return false_alarms(specs, runs, suffix)
    measured = {s.id: {} for s in specs}
    for cls, cls_runs in runs.items():
        for cp, m in worst_of(cls_runs, a.gpu_layers).items():
            measured[cp][cls + suffix] = m
            print(f"{cls + suffix:10s} cp{cp:3s} nmse {m['worst_nmse']:.3e} max_abs {m['worst_max_abs']:.3e} "
                  f"agree {m['min_agreement']:.3f}")
    if a.write:
        write_bands(specs, measured, a, prompts, keep_others=bool(a.classes or a.gpu_layers))
    return 0


def read_text(path: Path) -> str:
    """A measurements file, gzip-compressed where its name ends in .gz."""
    return gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()


def write_text(path: Path, text: str):
    path.write_bytes(gzip.compress(text.encode(), mtime=0) if path.suffix == ".gz" else text.encode())


def command(a, saved=True) -> str:
    cmd = "python tools/calibrate_bands.py --write --margin %g --greedy %d" % (a.margin, a.greedy)
    if a.classes:
        cmd += f" --classes {a.classes}"
    if a.gpu_layers:
        cmd += f" --gpu-layers {a.gpu_layers}"
    if saved and a.from_measurements:
        cmd += f" --from-measurements {a.from_measurements}"
    return cmd


def false_alarms(specs, runs, suffix) -> int:
    """Every held-out comparison against its band in the checkout (NMSE, argmax agreement, greedy prefix)."""
    by_id = {s.id: s for s in specs}
    for cls, cls_runs in runs.items():
        n = bad = 0
        for run in cls_runs:
            for r in run["rows"]:
                band = by_id[r["cp"]].band(cls + suffix)
                n += 1
                over = (("nmse" in band and (r.get("nmse") or 0.0) > band["nmse"])
                        or ("agreement" in band and r.get("agreement", 1.0) < band["agreement"])
                        or ("equal_prefix" in band and r.get("equal_prefix", 10**9) < band["equal_prefix"]))
                if over:
                    bad += 1
                    print(f"  {cls + suffix} false alarm: cp{r['cp']} layer {r['layer']} {r['tensor']} {r} "
                          f"band {band} ({run['prompt'][:30]!r})")
        print(f"{cls + suffix:10s} {bad} of {n} held-out comparisons outside their bands ({len(cls_runs)} prompts)")
    return 0


def measure(want, greedy, gpu_layers, prompts) -> dict:
    """{class: [{prompt, model, rows: [{cp, layer, tensor, metric: value}]}]}: llorch-ref (numpy, exact) against
    llama.cpp on each class's copy of the default model, every prompt."""
    sys.path.insert(0, str(Path(__file__).parent))
    from make_quant_copies import make_copies

    import llorch_ref
    from llorch_ref.harness.run import run_diff
    from llorch_ref.loaders.default_model import default_model_path, home

    orig = default_model_path()
    copies = make_copies(orig, home() / "models", ["f32", "f16", "q8_0", "q4_k_m"])
    runs = {}
    for cls in want:
        key, store = STORAGE[cls] if cls in STORAGE else (CLASSES[cls], "float32")
        path = orig if key is None else copies[key]
        eng = llorch_ref.load(path, weight_dtype=store)
        for p in prompts:
            t0 = time.perf_counter()
            # band_class F32 only selects which (placeholder) band is printed; we read the raw figures
            r = run_diff(eng, prompt=p, n_greedy=greedy, band_class="F32", n_gpu_layers=gpu_layers)
            rows = [{"cp": x.checkpoint, "layer": x.layer, "tensor": x.tensor,
                     **{k: v for k, v in x.metrics.items() if isinstance(v, (int, float))}} for x in r.rows]
            runs.setdefault(cls, []).append({"prompt": p, "model": path.name, "rows": rows,
                                             **({"storage": store} if cls in STORAGE else {})})
            print(f"{cls:5s} {time.perf_counter() - t0:5.1f}s {p[:40]!r}", file=sys.stderr)
    return runs


def worst_of(cls_runs, gpu_layers) -> dict:
    """Per checkpoint: the worst NMSE, max abs and cosine, the least argmax agreement and greedy equal prefix."""
    worst = {}
    for run in cls_runs:
        for r in run["rows"]:
            w = worst.setdefault(r["cp"], {"worst_nmse": 0.0, "worst_max_abs": 0.0, "min_cosine": 1.0,
                                           "min_agreement": 1.0, "model": run["model"], "prompts": len(cls_runs)})
            w["worst_nmse"] = max(w["worst_nmse"], r.get("nmse") or 0.0)
            w["worst_max_abs"] = max(w["worst_max_abs"], r.get("max_abs") or 0.0)
            w["min_cosine"] = min(w["min_cosine"], r.get("cosine", 1.0))
            w["min_agreement"] = min(w["min_agreement"], r.get("agreement", 1.0))
            if "equal_prefix" in r:
                w["min_equal_prefix"] = min(w.get("min_equal_prefix", 10**9), r["equal_prefix"])
            if "storage" in run:
                w["storage"] = f"{run['storage']} (--weight-dtype {run['storage']} on the F32 copy)"
            if gpu_layers:
                w["gpu_layers"] = gpu_layers
    return worst


def write_bands(specs, measured, a, prompts, keep_others: bool):
    """Each spec's bands of the measured classes: margin x the worst NMSE; argmax agreement and greedy prefix
    exact (1.0) for F32/F16 on the CPU, else half the worst measured. keep_others: the other classes stay."""
    cmd = command(a)
    for s in specs:
        d = json.loads(s.path.read_text())
        bands = {k: v for k, v in d["bands"].items() if k != "ggml"} if keep_others else {}
        for cls, m in measured[s.id].items():
            exact = cls in EXACT
            if s.id in ("0",):
                bands[cls] = {"agreement": 1.0}
            elif s.id == "10":
                bands[cls] = {"agreement": 1.0 if exact else math.floor(m["min_agreement"] / 2 * 100) / 100}
            elif s.id == "12":
                bands[cls] = {"agreement": 1.0} if exact else {"equal_prefix": int(m["min_equal_prefix"] // 2)}
            else:
                bands[cls] = {"nmse": float(f"{max(m['worst_nmse'], 1e-15) * a.margin:.1e}")}
        keep_ggml = {k: d.get(k, {}).get("ggml") for k in ("bands", "measured")}    # set by --ggml, kept
        d["bands"] = bands
        old = d.get("measured", {})
        by_class = {**(old.get("by_class", {}) if keep_others else {}), **measured[s.id]}
        old_cmd = old.get("command")
        d["measured"] = {"command": cmd if not keep_others or not old_cmd or cmd in old_cmd else f"{old_cmd}; then {cmd}",
                         "margin": a.margin, "prompts": old.get("prompts", prompts) if a.gpu_layers else prompts,
                         "greedy_tokens": a.greedy, "by_class": by_class,
                         **({"gpu_prompts": prompts} if a.gpu_layers else
                            {"gpu_prompts": old["gpu_prompts"]} if keep_others and "gpu_prompts" in old else {})}
        for k, v in keep_ggml.items():
            if v is not None:
                d[k]["ggml"] = v
        s.path.write_text(json.dumps(d, indent=2) + "\n")
    print("bands written to", specs[0].path.parent, file=sys.stderr)


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
