"""ONNX Runtime GenAI as a third engine, on the default model (its Q4_1 file dequantized, built by onnxruntime-genai's
model builder into float32 and int4 ONNX models):

  calibrate   the local bands of numerics "ort" (ONNX Runtime's int8-activation MatMulNBits products): the clean
              int4 model against llorch-ref on its own weights, 5 prompts with a decode step each; band = 100 x the
              largest local NMSE, at least 1e-12 (the rule of every other declaration); written into
              llorch_ref/checkpoints/local_bands.json beside them.
  tables      every checkpoint of the fp32 and int4 models against llorch-ref (own weights, and the GGUF's),
              greedy tokens, first divergence; two planted changes in the int4 graph; -> results/onnx/checkpoints.md
  corpus      corpus statistics (llorch-ref eval, 20 chunks of 512) of ONNX Runtime int4 and fp32 and llama.cpp
              Q4_1 and Q4_K_M against the float32 reference, in one run -> results/onnx/corpus.md

    python tools/onnx_runtime_tables.py calibrate|tables|corpus
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
from local_sensitivity import PROMPTS  # noqa: E402

from llorch_ref.harness.bundle import cpu_model  # noqa: E402
from llorch_ref.loaders.default_model import home  # noqa: E402

MODELS = home() / "models"
Q41, F32, Q4KM = (MODELS / f"SmolLM2-135M-Instruct.{t}.gguf" for t in ("Q4_1", "F32", "Q4_K_M"))
PROMPT = "Once upon a time, there was a little"


def folders():
    from llorch_ref.references.onnx_runtime import onnx_folder_for
    return {p: onnx_folder_for(Q41, p) for p in ("fp32", "int4")}


def _compare(sub, eng):
    from llorch_ref.checkpoints import engine_band_class
    from llorch_ref.dump import Dump
    from llorch_ref.harness.run import run_subject

    d = sub.to_dump() if not isinstance(sub, Dump) else sub
    res = run_subject(eng, d, engine_band_class(eng))
    return res


def calibrate():
    import llorch_ref
    from llorch_ref.checkpoints import catalogue_path, engine_band_class
    from llorch_ref.harness.compare import compare_dumps
    from llorch_ref.references.llorch import record_engine
    from llorch_ref.references.onnx_runtime import dump_onnxruntime

    folder = folders()["int4"]
    eng = llorch_ref.load(folder, numerics="ort")
    worst, runs = {}, []
    for p in PROMPTS:
        ids = eng.tokenizer.encode(p)
        sub = dump_onnxruntime(folder, token_ids=ids, n_greedy=2, decode_steps=1)
        ref = record_engine(eng, ids, n_greedy=2, decode_ids=sub.extra["decode_token_ids"])
        res = compare_dumps(sub, ref, eng.config, engine_band_class(eng), local_engine=eng,
                            local_bands=lambda d, t: {"nmse": float("inf")})
        for r in res.rows:
            if r.local is not None and "nmse" in r.local and "(" not in r.tensor:     # not derived probabilities
                t = r.tensor.split("@")[0]
                f = worst.setdefault(t, {"nmse": 0.0, "max_abs": 0.0})
                f["nmse"], f["max_abs"] = max(f["nmse"], r.local["nmse"]), max(f["max_abs"], r.local["max_abs"])
        runs.append(f"onnxruntime int4: {p!r}")
        print(f"{p[:30]!r:34s} worst local NMSE {max(r.local['nmse'] for r in res.rows if r.local and 'nmse' in r.local):.3e}")
    bands = {t: {"nmse": max(100 * f["nmse"], 1e-12)} for t, f in worst.items()}
    bands["default"] = {"nmse": max(b["nmse"] for b in bands.values())}
    path = catalogue_path() / "local_bands.json"
    out = json.loads(path.read_text())
    out["bands"]["ort/float32"] = bands
    out.setdefault("measured", {})["ort/float32"] = {**worst, "runs": runs}
    out["about_ort"] = ("ort/float32: python tools/onnx_runtime_tables.py calibrate on " + cpu_model() + ": the clean "
                        "int4 model (onnxruntime-genai's builder, MatMulNBits block 32, accuracy_level 4) against "
                        "llorch-ref numerics ort on its own weights; band = 100 x the largest local NMSE, >= 1e-12")
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote ort/float32 into {path}")


def _row(label, res) -> str:
    from llorch_ref.harness.metrics import fmt
    fd = res.first_divergence
    n_local = sum(r.local_passed is not None for r in res.rows)
    bad_local = sum(r.local_passed is False for r in res.rows)
    worst_local = max((r.local["nmse"] for r in res.rows if r.local and "nmse" in r.local), default=None)
    worst = max((r.metrics["nmse"] for r in res.rows if "nmse" in r.metrics), default=None)
    g = res.greedy
    where = "none" if fd is None else (f"cp{fd['checkpoint']} {fd['tensor']}" + ("" if fd["layer"] is None else
                                        f" L{fd['layer']}") + f" (by {fd['by']})")
    return (f"| {label} | {res.local_declaration} | {len(res.rows)} | {sum(not r.passed for r in res.rows)} | "
            f"{fmt(worst)} | {n_local - bad_local}/{n_local} | {fmt(worst_local)} | "
            f"{g['equal_prefix']}/{g['n']} | {len({u['checkpoint'] + u['tensor'] for u in res.not_covered})} | {where} |")


def tables():
    import llorch_ref
    from llorch_ref.harness.metrics import summary_markdown
    from llorch_ref.references.onnx_runtime import dump_onnxruntime
    from llorch_ref.testing.plant import plant_onnx

    f = folders()
    lines = ["# ONNX Runtime GenAI against llorch-ref", "",
             f"`python tools/onnx_runtime_tables.py tables` on {cpu_model()}; onnxruntime "
             f"{__import__('onnxruntime').__version__}, onnxruntime-genai {__import__('onnxruntime_genai').__version__}. "
             f"Models: the default model's Q4_1 file dequantized into a Hugging Face folder, built by onnxruntime-genai's "
             f"model builder (`-e cpu -p fp32` and `-p int4`: MatMulNBits, block 32, accuracy_level 4, symmetric). Prompt "
             f"{PROMPT!r} (9 tokens), 4 teacher-forced decode steps, 32 greedy tokens. Every run: `llorch-ref dump "
             f"--engine onnxruntime --model M --decode-steps 4`, then `llorch-ref diff --subject D --model R` "
             f"[--numerics exact].", "",
             "| subject vs reference weights | local arithmetic | comparisons | outside end-to-end band | worst NMSE | "
             "local inside | worst local NMSE | greedy equal | not covered (tensors) | first divergence |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    details = []
    runs = [("fp32 ONNX vs its own weights (ONNX folder)", "fp32", f["fp32"], "exact"),
            ("fp32 ONNX vs the GGUF's weights (F32 copy)", "fp32", F32, "exact"),
            ("int4 ONNX vs its own weights (ONNX folder, int8 activations)", "int4", f["int4"], "ort"),
            ("int4 ONNX vs its own weights, exact float32 arithmetic", "int4", f["int4"], "exact"),
            ("int4 ONNX vs the GGUF's Q4_1 weights", "int4", Q41, "exact")]
    dumps = {}
    for label, prec, ref_model, numerics in runs:
        if prec not in dumps:
            dumps[prec] = dump_onnxruntime(f[prec], prompt=PROMPT, n_greedy=32, decode_steps=4).to_dump()
        t = time.perf_counter()
        eng = llorch_ref.load(ref_model, numerics=numerics, weights="eager")
        res = _compare(dumps[prec], eng)
        print(f"{label}: {time.perf_counter() - t:.0f} s, first divergence {res.first_divergence}")
        lines.append(_row(label, res))
        details += ["", f"### {label}", "", *summary_markdown(res.summary())]
    with tempfile.TemporaryDirectory(dir="/dev/shm") as tmp:
        lines += ["", "## Planted changes in the int4 graph, against the clean int4 folder (numerics ort)", "",
                  "| planted change | first divergence | its local NMSE (band) | end-to-end NMSE there |", "|---|---|---|---|"]
        plants = [("model.layers.11.mlp.up_proj.MatMul.weight_scales x1.05 (a 5% scale on one int4 matrix)",
                   "model.layers.11.mlp.up_proj.MatMul.weight_scales", lambda a: a.__imul__(np.float32(1.05))),
                  ("cos_cache row 4 set to row 5 (RoPE of position 4 rotates as position 5)", "cos_cache",
                   lambda a: a.__setitem__(4, a[5].copy())),
                  ("model.layers.11.mlp.up_proj.MatMul.weight_scales x1.01 (1%)",
                   "model.layers.11.mlp.up_proj.MatMul.weight_scales", lambda a: a.__imul__(np.float32(1.01)))]
        clean = llorch_ref.load(f["int4"], numerics="ort")
        for i, (label, init, change) in enumerate(plants):
            d = plant_onnx(f["int4"], Path(tmp) / f"p{i}", init, change)
            res = _compare(dump_onnxruntime(d, prompt=PROMPT, n_greedy=8).to_dump(), clean)
            fd = res.first_divergence
            row = min((r for r in res.rows if r.diverges), key=lambda r: r.order) if fd else None
            lines.append(f"| {label} | " + ("none" if fd is None else
                         f"cp{fd['checkpoint']} {fd['tensor']} L{fd['layer']} (by {fd['by']})") + " | " +
                         (f"{row.local['nmse']:.3e} ({row.local_band['nmse']:.2g})" if row is not None and row.local else "-")
                         + " | " + (f"{row.metrics['nmse']:.3e}" if row is not None else "-") + " |")
            print(lines[-1])
    lines += ["", "## Every checkpoint, per run", *details, ""]
    out = ROOT / "results" / "onnx" / "checkpoints.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")


def corpus(only=()):
    """Each row's eval JSON in results/onnx/<row>.json (rows named in `only` are run again, others only if
    missing); the table is made from every JSON there."""
    f = folders()
    rows = [("onnxruntime-int4-vs-f32", ["--subject", "onnxruntime", "--subject-model", str(f["int4"])],
             "ONNX Runtime GenAI int4 (MatMulNBits, requantized from the Q4_1 values)"),
            ("llorch-on-ort-int4-weights-vs-f32", ["--subject", "numpy", "--subject-model", str(f["int4"])],
             "llorch-ref exact on the int4 folder's own weights (dequantized): the int4 quantization alone"),
            ("onnxruntime-fp32-vs-f32", ["--subject", "onnxruntime", "--subject-model", str(f["fp32"])],
             "ONNX Runtime GenAI fp32 (the same values as the F32 parent)"),
            ("llamacpp-q4_1-vs-f32", ["--subject", "llamacpp", "--subject-model", str(Q41)],
             "llama.cpp on the Q4_1 file (the F32 parent's own values: its arithmetic only)"),
            ("llamacpp-q4_k_m-vs-f32", ["--subject", "llamacpp", "--subject-model", str(Q4KM)],
             "llama.cpp on the Q4_K_M copy (requantized by llama.cpp's quantizer)")]
    out_dir = ROOT / "results" / "onnx"
    out_dir.mkdir(parents=True, exist_ok=True)
    lines = ["# Corpus statistics: ONNX Runtime GenAI and llama.cpp against the float32 reference", "",
             f"On {cpu_model()}: each row is `llorch-ref eval --model {F32.name} <subject> --ctx 512 --chunks 20 "
             f"--json <row>.json` (the default corpus, Hamlet; reference: llorch-ref numpy exact on the F32 parent, "
             f"which is the Q4_1 file dequantized); `python tools/onnx_runtime_tables.py corpus [row ...]`. Same top p "
             f"and RMS Δp in percent.", "",
             "| row | subject | Mean KLD | 99.9% KLD | Maximum KLD | Same top p | Mean PPL(Q)/PPL(base) | RMS Δp | wall (s) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, args, what in rows:
        js = out_dir / f"{name}.json"
        if name in only or not js.exists():
            t = time.perf_counter()
            subprocess.run([sys.executable, "-m", "llorch_ref.cli", "eval", "--model", str(F32), *args, "--ctx", "512",
                            "--chunks", "20", "--json", str(js), "--overwrite"], check=True, capture_output=True)
            data = json.loads(js.read_text())
            data["wall_s"] = round(time.perf_counter() - t, 1)
            js.write_text(json.dumps(data))
        data = json.loads(js.read_text())
        s = data["statistics"]
        v = lambda k, pct=False, s=s: (f"{s[k][0] * (100 if pct else 1):.6g} ± {s[k][1] * (100 if pct else 1):.2g}"
                                        if isinstance(s[k], list) else f"{s[k]:.6g}")
        lines.append(f"| {name} | {what} | {v('Mean KLD')} | {v('99.9% KLD')} | {v('Maximum KLD')} | "
                     f"{v('Same top p', True)} | {v('Mean PPL(Q)/PPL(base)')} | {v('RMS Δp', True)} | "
                     f"{data.get('wall_s', '-')} |")
        print(lines[-1], flush=True)
    (out_dir / "corpus.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    if sys.argv[1] == "corpus":
        corpus(sys.argv[2:])
    else:
        {"calibrate": calibrate, "tables": tables}[sys.argv[1]]()
