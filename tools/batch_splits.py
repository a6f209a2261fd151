"""One prompt through llama.cpp as one batch, as micro-batches and token by token (n_ubatch 512, 7, 1; other
values with --ubatch), each dump compared with the reference: llorch-ref in llama.cpp's declared arithmetic
(local errors, op by op, and end to end against the bit-exact ggml band) and in exact float32 (the weight
class's bands), and with llama.cpp's own one-batch run (its logits).

    python tools/batch_splits.py [--model M] [--ubatch 512,7,1] [--settings f32,production]
        --out results/batch/llamacpp-ubatch-default-model.md
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

import llorch_ref
from llorch_ref.checkpoints import engine_band_class
from llorch_ref.harness.bundle import cpu_model
from llorch_ref.harness.compare import compare_dumps
from llorch_ref.harness.metrics import fmt
from llorch_ref.harness.run import run_subject
from llorch_ref.loaders.default_model import resolve_model
from llorch_ref.references.engines import dump_llamacpp
from llorch_ref.references.llorch import record_engine

PROMPT = ("The history of the Roman Empire spans many centuries, from the founding of the city on the banks of "
          "the Tiber to the fall of Constantinople in 1453. Its institutions, roads and laws shaped the languages "
          "and borders of Europe long after the last emperor, and historians still argue about why it")
SETTINGS = {"f32": dict(kv_dtype="float32", flash_attn=False),
            "production": dict(kv_dtype="float16", flash_attn=True)}


def figures(res) -> dict:
    rows = [r for r in res.rows if r.step == 0]
    logits = next(r for r in rows if r.checkpoint == "8" and r.tensor == "logits")
    local = [r for r in rows if r.local is not None and "nmse" in r.local]
    worst_local = max(local, key=lambda r: r.local["nmse"]) if local else None
    argmax = next(r for r in rows if r.checkpoint == "10")
    fd = res.first_divergence
    tensors = [r for r in rows if "max_abs" in r.metrics]
    return {"failed": sum(not r.passed for r in rows), "rows": len(rows),
            "bit_equal": f"{sum(r.metrics['max_abs'] == 0 for r in tensors)} of {len(tensors)}",
            "first": "none" if fd is None else f"cp{fd['checkpoint']} {fd['tensor']} L{fd['layer']} ({fd['by']})",
            "local_failed": sum(r.local_passed is False for r in local),
            "worst_local": "-" if worst_local is None else
                           f"{fmt(worst_local.local['nmse'])} ({worst_local.tensor} L{worst_local.layer})",
            "logits_nmse": fmt(logits.metrics["nmse"]), "logits_max_abs": fmt(logits.metrics["max_abs"]),
            "argmax": f"{argmax.metrics['agreement']:.3f}"}


def main():
    ap = argparse.ArgumentParser(allow_abbrev=False)
    ap.add_argument("--model", default=None)
    ap.add_argument("--ubatch", default="512,7,1")
    ap.add_argument("--settings", default="f32,production")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    path = resolve_model(a.model)
    lines = [f"# llama.cpp's micro-batches on one prompt: {path.name}", "",
             f"Command: `python tools/batch_splits.py --ubatch {a.ubatch} --settings {a.settings} --out {a.out}`"
             + ("" if a.model is None else f" --model {a.model}"), f"CPU: {cpu_model()}.", ""]
    for setting in a.settings.split(","):
        kw = SETTINGS[setting]
        ggml = llorch_ref.load(path, numerics="ggml", kv_dtype=kw["kv_dtype"])
        exact = llorch_ref.load(path)
        ids = ggml.tokenizer.encode(PROMPT)
        band = engine_band_class(exact)
        lines += [f"## llama.cpp with K/V {kw['kv_dtype']}, flash attention {'on' if kw['flash_attn'] else 'off'}: "
                  f"{len(ids)} tokens", "",
                  f"| n_ubatch | graphs | reference | tensors bit-equal | rows off the {band} band | first divergence | "
                  "local checks failed | worst local NMSE | logits NMSE | logits max abs | argmax agreement | "
                  "llama.cpp vs its own one batch (logits max abs) | time (s) |", "|" + "---|" * 13]
        whole = None
        for u in [int(x) for x in a.ubatch.split(",")]:
            t0 = time.perf_counter()
            d = dump_llamacpp(path, token_ids=ids, n_greedy=0, n_ubatch=u, **kw).to_dump()
            logits = d.raw("8", "logits").reshape(len(ids), -1)
            whole = logits if whole is None else whole
            vs_self = fmt(float(np.abs(logits - whole).max()))
            for name, eng in (("llorch-ref, ggml (declared)", ggml), ("llorch-ref, exact float32", exact)):
                if eng is ggml:
                    f = figures(run_subject(eng, d, band))
                else:                         # local checks hold a subject to its declared arithmetic only
                    f = figures(compare_dumps(d, record_engine(eng, ids, n_greedy=0), eng.config, band))
                    f.update(first="(end to end only)", local_failed="-", worst_local="-")
                lines.append(f"| {u} | {-(-len(ids) // u)} | {name} | {f['bit_equal']} | {f['failed']} of {f['rows']} | "
                             f"{f['first']} | {f['local_failed']} | {f['worst_local']} | {f['logits_nmse']} | "
                             f"{f['logits_max_abs']} | {f['argmax']} | {vs_self} | {time.perf_counter() - t0:.0f} |")
                print(lines[-1], flush=True)
        lines.append("")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text("\n".join(lines) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
