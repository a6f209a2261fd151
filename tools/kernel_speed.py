"""Time numba's in-place products on the default model's matrices, from cache: one token and eight, 1 and 2 threads.

    python tools/kernel_speed.py [--model PATH] [--repeats 5]

Prints, per matrix (layer 0's gate and down, the tied Q8_0 output), the best of `repeats` timings of
numba_kernels.matmul_rows and the weights times tokens it multiplies a second. To compare two versions of the code,
use tools/kernel_ab.py (both in one process: the host's speed moves too much between processes).
"""
from __future__ import annotations

import argparse
import time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    import numba as nb
    import numpy as np

    from llorch_ref.backends import numba_kernels as K
    from llorch_ref.backends.numba_backend import KernelBlocks
    from llorch_ref.loaders.default_model import resolve_model
    from llorch_ref.loaders.gguf_file import load_gguf

    m = load_gguf(resolve_model(a.model))
    rng = np.random.default_rng(0)
    for key in [(0, "w_gate"), "output", (0, "w_down")]:
        kb = KernelBlocks([m.qtensors[key]])
        for t_n in (1, 8):
            x = rng.standard_normal((t_n, kb.k)).astype(np.float32)
            out = np.empty((t_n, kb.n), np.float32)
            for threads in (1, 2):
                nb.set_num_threads(threads)
                K.matmul_rows(kb.code, kb.rows, kb.n_blocks, x, out)
                reps = max(3, int(2e8 / (kb.n * kb.k * t_n)))
                best = min(_timed(K.matmul_rows, (kb.code, kb.rows, kb.n_blocks, x, out), reps)
                           for _ in range(a.repeats))
                print(f"{str(key):16s} {kb.qtype} {kb.n}x{kb.k} T={t_n} threads={threads}: {best * 1e6:8.1f} us "
                      f"{kb.n * kb.k * t_n / best / 1e9:6.2f} G weight-tokens/s", flush=True)


def _timed(fn, args, reps):
    t0 = time.perf_counter()
    for _ in range(reps):
        fn(*args)
    return (time.perf_counter() - t0) / reps


if __name__ == "__main__":
    main()
