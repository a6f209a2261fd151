"""Can the harness name a 1% error in one weight matrix? Planted scale errors, three subjects, local errors.

    python tools/local_sensitivity.py calibrate|check [--model M] [--subjects llamacpp,numba,transformers]
    python tools/local_sensitivity.py sweep [--model M] [--layers 1,15,28] [--factors 1.005,1.01,1.02,1.05]
                                            [--matrices q,k,v,o,gate,up,down] [--subjects ...] [--out PREFIX]

check: the false-alarm half of calibrate alone, under the stored bands (any model).
calibrate: the clean model, every subject, 5 prompts: the largest local NMSE of each tensor, per declared
arithmetic; writes checkpoints/local_bands.json (band = 100 x the largest clean figure, at least 1e-12) with
the raw figures, and reports whether any clean run diverges (a false alarm).
sweep: for each matrix, layer and factor, a copy of the model with that matrix's block scales multiplied
(llorch_ref.testing.plant), each subject run on the copy, and `compare_dumps` against the reference on the
original with the local comparison: where the first divergence is named, and whether it is the right
checkpoint and layer. Subjects: llamacpp, llamacpp-f16, llamacpp-fa and llamacpp-fa32 (llama.cpp through its
eval callback, K/V cache f32, f16, f16 with flash attention as llama.cpp runs by default, and f32 with flash
attention; all declare ggml arithmetic),
numba (llorch-ref's numba backend, exact), transformers (the copy converted to a Hugging Face folder, exact).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from llorch_ref.harness.bundle import cpu_model

PROMPTS = ["The capital of France is", "Once upon a time, there was a little",
           "def fibonacci(n):\n    if n < 2:", "In 1969, the first humans to walk on the Moon were",
           "Water boils at a temperature of"]
MATRICES = {"q": "attn_q", "k": "attn_k", "v": "attn_v", "o": "attn_output", "gate": "ffn_gate", "up": "ffn_up",
            "down": "ffn_down"}
# where a scale error in each matrix first shows, locally: (checkpoint, tensor)
EXPECT = {"q": ("2", "q_proj"), "k": ("2", "k_proj"), "v": ("2", "v"), "o": ("5", "attn_out"),
          "gate": ("6", "ffn_swiglu"), "up": ("6", "ffn_swiglu"), "down": ("6", "ffn_out")}


class References:
    """The reference engines on the original model, one per declared arithmetic, and their records per prompt."""

    def __init__(self, model):
        import llorch_ref

        self.model = model
        self.engines = {"ggml/float32": llorch_ref.load(model, numerics="ggml"),
                        "ggml/float16": llorch_ref.load(model, numerics="ggml", kv_dtype="float16"),
                        "exact/float32": llorch_ref.load(model, numerics="exact", weights="eager")}
        self.records = {}

    def record(self, decl, ids):
        from llorch_ref.references.llorch import record_engine

        key = (decl, tuple(ids))
        if key not in self.records:
            self.records[key] = record_engine(self.engines[decl], ids, n_greedy=2)
        return self.records[key]


def subject_dump(kind, model_path, ids, work: Path):
    """-> (Recorder, declaration) of one subject engine run on model_path."""
    if kind in ("llamacpp", "llamacpp-f16", "llamacpp-fa", "llamacpp-fa32"):
        from llorch_ref.references.engines import dump_llamacpp
        kv = "float32" if kind in ("llamacpp", "llamacpp-fa32") else "float16"
        fa = kind in ("llamacpp-fa", "llamacpp-fa32")
        return (dump_llamacpp(model_path, token_ids=ids, n_greedy=2, kv_dtype=kv, flash_attn=fa),
                f"ggml/{kv}" + ("+flash_attn" if fa else ""))
    if kind == "numba":
        import llorch_ref
        from llorch_ref.references.llorch import record_engine
        return record_engine(llorch_ref.load(model_path, backend="numba"), ids, n_greedy=2), "exact/float32"
    if kind == "transformers":
        from llorch_ref.convert import convert_gguf_to_hf
        from llorch_ref.references.engines import dump_transformers
        hf = work / "hf"
        convert_gguf_to_hf(model_path, hf, overwrite=True)
        return dump_transformers(hf, token_ids=ids, n_greedy=2), "exact/float32"
    raise SystemExit(f"unknown subject {kind}")


def compare(refs, sub, decl, ids, measure_only=False):
    from llorch_ref.checkpoints import engine_band_class, local_band
    from llorch_ref.harness.compare import compare_dumps

    eng = refs.engines[decl.split("+")[0]]
    bands = (lambda d, t: {"nmse": float("inf")}) if measure_only else local_band
    return compare_dumps(sub, refs.record(decl.split("+")[0], ids), eng.config, engine_band_class(eng), local_engine=eng,
                         local_bands=bands)


def calibrate(args, refs, tok):
    figures = {}
    for kind in args.subjects:
        for prompt in PROMPTS:
            ids = tok.encode(prompt)
            with tempfile.TemporaryDirectory(dir="/dev/shm" if Path("/dev/shm").is_dir() else None) as d:
                sub, decl = subject_dump(kind, refs.model, ids, Path(d))
            res = compare(refs, sub, decl, ids, measure_only=True)
            decl = res.local_declaration
            for r in res.rows:
                if r.local is not None and "nmse" in r.local:
                    f = figures.setdefault(decl, {}).setdefault(r.tensor, {"nmse": 0.0, "max_abs": 0.0, "runs": []})
                    f["nmse"] = max(f["nmse"], r.local["nmse"])
                    f["max_abs"] = max(f["max_abs"], r.local["max_abs"])
            print(f"{kind:13s} {prompt[:30]!r:34s} worst local NMSE "
                  f"{max((r.local['nmse'] for r in res.rows if r.local and 'nmse' in r.local), default=0):.3e}", flush=True)
            figures[decl].setdefault("_runs", []).append(f"{kind}: {prompt!r}")
    bands = {}
    for decl, per in figures.items():
        bands[decl] = {t: {"nmse": max(100 * f["nmse"], 1e-12)} for t, f in per.items() if not t.startswith("_")}
        bands[decl]["default"] = {"nmse": max(b["nmse"] for b in bands[decl].values())}
    out = {"about": "Local (teacher-forced) bands per declared arithmetic: 100 x the largest local NMSE measured "
                    "on the clean model, at least 1e-12. Made by: python " + " ".join(sys.argv) +
                    f" on {cpu_model()}. A scale error of e in one matrix gives a local NMSE of about e^2 "
                    f"(0.5%: 2.5e-5).",
           "bands": bands,
           "measured": {d: {t: {"nmse": f["nmse"], "max_abs": f["max_abs"]} for t, f in per.items()
                            if not t.startswith("_")} | {"runs": per["_runs"]} for d, per in figures.items()}}
    from llorch_ref.checkpoints import catalogue_path
    path = catalogue_path() / "local_bands.json"
    if path.exists():                               # keep the declarations this run did not measure
        old = json.loads(path.read_text())
        if set(old.get("bands", {})) - set(bands):     # the others' command stays named
            out["about"] = (f"{old['about']} Then python {' '.join(sys.argv)} on {cpu_model()} for "
                            f"{', '.join(sorted(bands))}.")
        out["bands"] = {**old.get("bands", {}), **out["bands"]}
        out["measured"] = {**old.get("measured", {}), **out["measured"]}
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path}")
    from llorch_ref import checkpoints
    checkpoints._local_bands.cache_clear()
    check(args, refs, tok)


def check(args, refs, tok):
    """False alarms: the clean model, every subject, 5 prompts, under the stored bands."""
    alarms, worst = [], {}
    for kind in args.subjects:                      # false alarms under the stored bands
        for prompt in PROMPTS:
            ids = tok.encode(prompt)
            with tempfile.TemporaryDirectory() as d:
                sub, decl = subject_dump(kind, refs.model, ids, Path(d))
            res = compare(refs, sub, decl, ids)
            if res.first_divergence is not None:
                alarms.append((kind, prompt, res.first_divergence))
            w = max(((r.local["nmse"] / r.local_band["nmse"], r.tensor) for r in res.rows
                     if r.local and "nmse" in r.local and "nmse" in (r.local_band or {})), default=(0, "-"))
            worst[kind] = max(worst.get(kind, (0, "-")), w)
    line = (f"false alarms on the clean model ({Path(refs.model).name}): {len(alarms)} of "
            f"{len(args.subjects) * len(PROMPTS)} runs {alarms}; largest local NMSE / band per subject: "
            + ", ".join(f"{k} {v[0]:.3g} ({v[1]})" for k, v in worst.items()))
    print(line)
    if args.out:
        Path(args.out + "-false-alarms.md").write_text(f"`python {' '.join(sys.argv)}` on {cpu_model()}\n\n{line}\n")


def sweep(args, refs, tok):
    from llorch_ref.testing.plant import plant_scale

    ids = tok.encode(PROMPTS[0])
    rows = []
    tmp = Path(tempfile.mkdtemp(dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    for layer in args.layers:
        for mat in args.matrices:
            for factor in args.factors:
                mutated = tmp / "mutated.gguf"
                plant_scale(refs.model, mutated, f"blk.{layer}.{MATRICES[mat]}.weight", factor)
                for kind in args.subjects:
                    t0 = time.perf_counter()
                    sub, decl = subject_dump(kind, mutated, ids, tmp)
                    res = compare(refs, sub, decl, ids)
                    fd = res.first_divergence
                    want = EXPECT[mat]
                    right = fd is not None and fd["layer"] == layer and (fd["checkpoint"], fd["tensor"]) == want
                    row = next((r for r in res.rows if r.layer == layer and r.tensor == want[1]), None)
                    rows.append({"subject": kind, "declaration": decl, "matrix": mat, "layer": layer,
                                 "factor": factor, "first_divergence": fd, "right": right,
                                 "local_nmse_at_the_bug": row.local["nmse"] if row and row.local else None,
                                 "e2e_nmse_at_the_bug": row.metrics.get("nmse") if row else None,
                                 "seconds": time.perf_counter() - t0})
                    print(json.dumps(rows[-1]), flush=True)
    report = {"command": "python " + " ".join(sys.argv), "cpu": cpu_model(), "model": str(refs.model),
              "prompt": PROMPTS[0], "rows": rows}
    Path(args.out + ".json").write_text(json.dumps(report, indent=1) + "\n")
    lines = ["# Planted scale errors, named by local error", "", f"`{report['command']}` on {report['cpu']}; model "
             f"{Path(refs.model).name}; prompt {PROMPTS[0]!r}.", "",
             "| subject | declaration | matrix | layer | factor | first divergence | right place | local NMSE at the bug | end-to-end NMSE there |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        fd = r["first_divergence"]
        where = "none" if fd is None else f"cp{fd['checkpoint']} L{fd['layer']} {fd['tensor']}"
        fmt = lambda x: "-" if x is None else f"{x:.2e}"
        lines.append(f"| {r['subject']} | {r['declaration']} | {r['matrix']} | {r['layer']} | {r['factor']} | {where} | "
                     f"{'yes' if r['right'] else 'NO'} | {fmt(r['local_nmse_at_the_bug'])} | {fmt(r['e2e_nmse_at_the_bug'])} |")
    by = {}
    for r in rows:
        by.setdefault((r["subject"], r["factor"]), []).append(r["right"])
    lines += ["", "| subject | factor | named at the right checkpoint and layer |", "|---|---|---|"]
    lines += [f"| {s} | {f} | {sum(v)} of {len(v)} |" for (s, f), v in sorted(by.items())]
    Path(args.out + ".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[-len(by) - 2:]))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["calibrate", "check", "sweep"])
    ap.add_argument("--model", default=None)
    ap.add_argument("--subjects", default="llamacpp,llamacpp-f16,llamacpp-fa,numba,transformers")
    ap.add_argument("--layers", default="1,15,28")
    ap.add_argument("--matrices", default="q,k,v,o,gate,up,down")
    ap.add_argument("--factors", default="1.005,1.01,1.02,1.05")
    ap.add_argument("--out", default="results/local/sensitivity")
    args = ap.parse_args()
    args.subjects = args.subjects.split(",")
    args.layers = [int(x) for x in args.layers.split(",")]
    args.matrices = args.matrices.split(",")
    args.factors = [float(x) for x in args.factors.split(",")]
    from llorch_ref.loaders.default_model import resolve_model
    refs = References(resolve_model(args.model))
    tok = refs.engines["exact/float32"].tokenizer
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    {"calibrate": calibrate, "check": check, "sweep": sweep}[args.what](args, refs, tok)


if __name__ == "__main__":
    main()
