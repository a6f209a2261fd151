"""A prompt's speed on the numba backend by path, at several prompt lengths: the kernels on the file's blocks (the
default where they serve every matrix) against BLAS on float32 layers kept by --weight-cache-mb, in one process,
alternating, so that a machine whose speed moves moves both alike.

    python tools/prompt_paths.py --model /tmp/big/l7-q4k.gguf --tokens 8,32,128 --cache-mb 30000

Prints tokens/s (the median of --rounds after a warm-up) and the peak of each engine's cached float32 layers. The
BLAS side needs --cache-mb large enough for the layers (else they are dequantized at every use)."""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="GGUF file (default: the default model)")
    ap.add_argument("--tokens", default="8,32,64,128,256")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--cache-mb", type=float, default=8000.0, help="the BLAS side's --weight-cache-mb")
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()

    import llorch_ref

    engines = {"kernels on the blocks": llorch_ref.load(a.model, backend="numba", threads=a.threads),
               "BLAS on float32": llorch_ref.load(a.model, backend="numba", threads=a.threads,
                                                  weight_cache_mb=a.cache_mb)}
    vocab = next(iter(engines.values())).config.n_vocab
    print(f"model {a.model or 'default'}, threads {a.threads or 'all'}, medians of {a.rounds} rounds")
    print("| tokens | " + " | ".join(engines) + " | kernels / BLAS |")
    print("|---|" + "---|" * (len(engines) + 1))
    for n in (int(t) for t in a.tokens.split(",")):
        ids = [int(i) for i in np.random.default_rng(n).integers(1, vocab, n)]
        took = {name: [] for name in engines}
        for r in range(a.rounds + 1):
            for name, eng in engines.items():
                time.sleep(0.3)                         # the other engine's BLAS threads stop spinning (see above)
                eng.forward(ids, eng.new_cache())       # untimed: this engine's threads awake
                t = time.perf_counter()
                eng.forward(ids, eng.new_cache())
                if r:                                   # round 0 also fills the BLAS side's cache
                    took[name].append(time.perf_counter() - t)
        speed = {name: n / statistics.median(v) for name, v in took.items()}
        k, b = speed.values()
        print(f"| {n} | " + " | ".join(f"{s:.1f}" for s in speed.values()) + f" | {k / b:.2f}x |")
    for name, eng in engines.items():
        info = eng.weights_info()
        print(f"{name}: float32 layers kept {info['used_mb']:.0f} MB of a budget of {info['budget_mb']:.0f} MB "
              f"({info['budget_by']})")


if __name__ == "__main__":
    main()
