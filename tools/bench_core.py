"""Load time, prefill and greedy decode speed: llorch-ref (NumPy) next to llama.cpp, same file, same run.

    python tools/bench_core.py [--model PATH] [--repeats 3] [--decode 64]

Medians of --repeats runs; llama.cpp with 2 threads, F32 KV cache, flash attention off (the harness settings).
Prints a Markdown table and the ratio of the two engines.
"""
from __future__ import annotations

import argparse
import statistics
import time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--decode", type=int, default=64)
    a = ap.parse_args()
    import llorch_ref
    from llorch_ref.loaders.default_model import default_model_path
    from llorch_ref.references.llamacpp import LlamaCpp

    path = a.model or default_model_path()
    rows = {"llorch-ref numpy": {}, "llama.cpp": {}}
    prompt_ids = None
    for _ in range(a.repeats):
        t0 = time.perf_counter()
        eng = llorch_ref.load(path)
        rows["llorch-ref numpy"].setdefault("load_s", []).append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        ref = LlamaCpp(path, n_ctx=512)
        rows["llama.cpp"].setdefault("load_s", []).append(time.perf_counter() - t0)
        prompt_ids = eng.tokenizer.encode(("The history of the world is long. " * 20))[:128]
        t0 = time.perf_counter()
        eng.logits(prompt_ids)
        rows["llorch-ref numpy"].setdefault("prefill_tok_s", []).append(len(prompt_ids) / (time.perf_counter() - t0))
        t0 = time.perf_counter()
        ref.eval(prompt_ids)
        rows["llama.cpp"].setdefault("prefill_tok_s", []).append(len(prompt_ids) / (time.perf_counter() - t0))
        short = prompt_ids[:8]
        from llorch_ref.engine import GenerationResult
        res = GenerationResult()
        list(eng.generate_ids(short, max_tokens=a.decode, ignore_eos=True, result=res))
        rows["llorch-ref numpy"].setdefault("decode_tok_s", []).append(a.decode / res.decode_s)
        t0 = time.perf_counter()
        ref.greedy(short, a.decode)
        rows["llama.cpp"].setdefault("decode_tok_s", []).append(a.decode / (time.perf_counter() - t0))
        ref.close()
    print(f"model: {path}; {len(prompt_ids)}-token prefill, {a.decode}-token greedy decode; medians of {a.repeats}\n")
    print("| engine | load s | prefill tok/s | decode tok/s |")
    print("|---|---|---|---|")
    med = {k: {m: statistics.median(v) for m, v in d.items()} for k, d in rows.items()}
    for k, d in med.items():
        print(f"| {k} | {d['load_s']:.2f} | {d['prefill_tok_s']:.0f} | {d['decode_tok_s']:.1f} |")
    o, r = med["llorch-ref numpy"], med["llama.cpp"]
    print(f"\nratios llorch-ref / llama.cpp: load {o['load_s'] / r['load_s']:.1f}x the time, "
          f"prefill {o['prefill_tok_s'] / r['prefill_tok_s']:.2f}x the speed, "
          f"decode {o['decode_tok_s'] / r['decode_tok_s']:.2f}x the speed")
    print("(llama.cpp's decode here includes a Python-side logits copy per token; it decodes through the "
          "low-level API with F32 KV)")


if __name__ == "__main__":
    main()
