"""Where llorch-ref's and llama.cpp's greedy texts part, print both sides' top two logits at that step.

    python tools/near_tie.py --model FILE.gguf [--prompt TEXT] [--tokens 4]
"""
from __future__ import annotations

import argparse

import numpy as np


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompt", default="Once upon a time, there was a little")
    ap.add_argument("--tokens", type=int, default=4)
    a = ap.parse_args()
    import llorch_ref
    from llorch_ref.references.llamacpp import LlamaCpp

    eng = llorch_ref.load(a.model)
    ids = eng.tokenizer.encode(a.prompt)
    ref = LlamaCpp(a.model, n_ctx=max(64, len(ids) + a.tokens + 8))
    try:
        theirs = ref.greedy(ids, a.tokens)
        ours = list(eng.generate_ids(ids, max_tokens=a.tokens, ignore_eos=True))
        print("llama.cpp (token by token):", theirs)
        print("llorch-ref:                ", ours)
        k = next((i for i, (x, y) in enumerate(zip(theirs, ours)) if x != y), None)
        if k is None:
            print("no divergence")
            return
        ctx = ids + theirs[:k]
        sides = (("llama.cpp (one batch)", ref.eval_last(ctx)),
                 ("llorch-ref", eng.forward(ctx, eng.new_cache(), rows=[len(ctx) - 1])[-1]))
    finally:
        ref.close()
    print(f"first difference at generated token {k}")
    for name, logits in sides:
        top = np.argsort(-logits)[:2]
        print(f"{name}: top two {top.tolist()} logits {[round(float(logits[t]), 4) for t in top]} "
              f"gap {float(logits[top[0]] - logits[top[1]]):.4f}")


if __name__ == "__main__":
    main()
