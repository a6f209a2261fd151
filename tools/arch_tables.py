"""Per architecture: a tiny random model made with transformers, converted to GGUF by llorch-ref, checked
checkpoint by checkpoint against transformers (HF folder) and llama.cpp (GGUF). One table per architecture.

    python tools/arch_tables.py --out results/cpu/2026-11-26-architectures.md
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from markdown_out import emit


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--archs", default="llama2,llama3,mistral,qwen2,phi3,gemma3,gpt2")
    ap.add_argument("--out")
    a = ap.parse_args()
    import llorch_ref
    from llorch_ref.convert import convert_hf_to_gguf
    from llorch_ref.harness.compare import compare_dumps
    from llorch_ref.harness.metrics import fmt, fmt_match
    from llorch_ref.harness.run import DEFAULT_PROMPT, run_diff
    from llorch_ref.references.engines import dump_transformers
    from llorch_ref.references.llorch import record_engine
    from llorch_ref.testing.tiny_hf import write_tiny_hf

    tmp = Path(tempfile.mkdtemp(prefix="llorch-archs-"))
    lines = ["# Architectures against transformers and llama.cpp", "",
             f"Command: `python tools/arch_tables.py --archs {a.archs}`. Each model: 2 layers (Gemma 3: 6, the last "
             f"global, the others local with a window of 8), D 64, F 96, 4 heads, "
             f"random weights from transformers (seed 0; biases and norm weights randomized too), saved as a "
             f"Hugging Face folder and converted to an F32 GGUF by `llorch-ref convert`. Prompt {DEFAULT_PROMPT!r}, "
             f"greedy 16 tokens. Worst NMSE over all layers; `n/c` = not covered by that reference. The ggml column: "
             f"llorch-ref with numerics='ggml' (llama.cpp's CPU arithmetic reproduced) vs llama.cpp, worst max abs "
             f"(0 = bit-equal). The band column: the band at the worst row vs llama.cpp.", ""]
    for arch in a.archs.split(","):
        folder, _ = write_tiny_hf(tmp / arch, arch)
        gguf_path = convert_hf_to_gguf(folder, tmp / f"{arch}.gguf")
        eng = llorch_ref.load(gguf_path)
        ids = eng.tokenizer.encode(DEFAULT_PROMPT)
        from llorch_ref.errors import ReferenceError_
        try:
            lc = run_diff(eng, prompt=DEFAULT_PROMPT, n_greedy=16)
        except ReferenceError_ as e:
            lc, lc_error = None, str(e)
        try:
            gg = run_diff(llorch_ref.load(gguf_path, numerics="ggml"), prompt=DEFAULT_PROMPT, n_greedy=16)
        except Exception as e:          # numerics='ggml' does not cover every architecture (Phi-3)
            gg, gg_error = None, f"{type(e).__name__}: {e}"
        tf = compare_dumps(record_engine(eng, ids, prompt=DEFAULT_PROMPT, n_greedy=16),
                           dump_transformers(folder, prompt=DEFAULT_PROMPT, token_ids=ids, n_greedy=16),
                           eng.config, "F32")
        c = eng.config
        lines += [f"## {arch} (`{c.arch}`: KV heads {c.n_kv_heads}/{c.n_heads}, tied {c.tied_output}, QKV bias "
                  f"{c.qkv_bias}, " + (f"RoPE {c.rope_style}, theta {c.rope_base:g}" if c.uses_rope else
                                        "learned positions, LayerNorm, GELU MLP with biases")
                  + (", llama3 frequency factors" if c.rope_freq_factors else "") + ")", "",
                  (f"first divergence vs llama.cpp: {lc.first_divergence or 'none'}; " if lc else
                   f"llama.cpp: not run ({lc_error}); ")
                  + f"vs transformers: {tf.first_divergence or 'none'}; greedy "
                  + (f"{lc.greedy['equal_prefix']}/16 and " if lc else "")
                  + f"{tf.greedy['equal_prefix']}/16 tokens equal"
                  + (f"; ggml numerics: first divergence {gg.first_divergence or 'none'}, greedy "
                     f"{gg.greedy['equal_prefix']}/16" if gg else f"; ggml numerics: not run ({gg_error[:120]})"),
                  *([""] + [f"warning: {w}" for w in lc.warnings] if lc and lc.warnings else []), "",
                  "| checkpoint | name | vs llama.cpp (GGUF) | vs transformers (HF folder) | ggml numerics vs llama.cpp "
                  "(max abs) | band |", "|---|---|---|---|---|---|"]
        by_gg = {s["checkpoint"]: s for s in gg.summary()} if gg else {}
        if lc and lc.warnings:        # a reduced-precision llama.cpp node: what came before it met the F32 bands
            from llorch_ref.harness.compare import reduced_precision_from
            fl = reduced_precision_from(lc.specs, c, "F32")
            early = [r for r in lc.rows if r.layer is not None and (r.layer, r.order[-1]) < fl["pos"][1:]]
            worst = max(early, key=lambda r: r.metrics["nmse"])
            lines.insert(len(lines) - 3, f"before that node (layer 0 up to {fl['pos']}): {len(early)} comparisons "
                         f"at F32 bands, all {'passed' if all(r.passed for r in early) else 'NOT passed'}, worst "
                         f"NMSE {fmt(worst.metrics['nmse'])} (cp{worst.checkpoint} {worst.tensor})")
        by_lc = {s["checkpoint"]: s for s in lc.summary()} if lc else {}
        for t in tf.summary():
            s = by_lc.get(t["checkpoint"])

            def cell(x):
                if x is None or x["passed"] is None:
                    return "n/c"
                v = fmt(x["worst_nmse"]) if x["worst_nmse"] is not None else fmt_match(x)
                return v + ("" if x["passed"] else " FAIL") + (f" ({x['not_covered']} n/c)" if x.get("not_covered") else "")
            g = by_gg.get(t["checkpoint"])
            gcell = "n/a" if g is None else (fmt(g["worst_max_abs"]) if g["worst_max_abs"] is not None else
                                             cell(g)) + ("" if g["passed"] in (True, None) else " FAIL")
            lines.append(f"| {t['checkpoint']} | {t['name']} | {cell(s)} | {cell(t)} | {gcell} | "
                         f"`{(s or t)['band']}` |")
        lines.append("")
    emit(lines, a.out)


if __name__ == "__main__":
    main()
