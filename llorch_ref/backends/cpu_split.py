"""Several-token products and attention on the CPU, split over llorch-ref's own threads, each part one
single-threaded BLAS call.

OpenBLAS's own threads divide a product statically and wait for each other spinning; on a machine where other
processes hold the cores, a thread the scheduler parks holds the whole product back while its partner spins (the
default model's prefill at 2 threads with both cores busy: 74 tok/s, runs from 26 to 148, against 185, runs from
172 to 319, split this way; results/cpu/busy-cores.md). Here BLAS runs on one thread; a product is cut into row
panels of the weight and attention into groups of KV heads, one part per thread (the calling thread takes the
first, the others a small pool's workers, which sleep between parts). Each output element is computed by the
same BLAS call shape as before (a product's panel rows, a head's matrices), so the results equal the unsplit
ones to the bit (tests/test_backends.py).
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np


class CpuSplit:
    """run(fn, parts), product(x, w), attention_out(attention, ...) over `threads` threads (1: in the caller)."""

    def __init__(self, threads: int = 1):
        self.threads, self.pool = 1, None
        self.configure(threads)

    def configure(self, threads: int):
        if threads != self.threads:
            if self.pool is not None:
                self.pool.shutdown(wait=True)
            self.threads = threads
            self.pool = ThreadPoolExecutor(threads - 1, thread_name_prefix="llorch-split") if threads > 1 else None

    def run(self, fn, parts: int):
        """fn(0), ..., fn(parts - 1): part 0 in the calling thread, the others on the pool; returns when all are done
        (an exception in any part is raised here)."""
        if self.pool is None or parts == 1:
            for i in range(parts):
                fn(i)
            return
        futures = [self.pool.submit(fn, i) for i in range(1, parts)]
        try:
            fn(0)
        finally:
            for f in futures:
                f.result()

    def product(self, x, w):
        """x: [T, K] f32, w: [N, K] f32 -> x @ w.T [T, N] f32, one row panel of w a thread."""
        n = w.shape[0]
        parts = max(1, min(self.threads, n // 64))
        if parts == 1:
            return x @ w.T
        out = np.empty((x.shape[0], n), dtype=np.result_type(x, w))
        bounds = [n * i // parts for i in range(parts + 1)]

        def one(i):
            lo, hi = bounds[i], bounds[i + 1]
            np.matmul(x, w[lo:hi].T, out=out[:, lo:hi])
        self.run(one, parts)
        return out

    def attention_out(self, attention, xp, q, k, v, mask, scale, kv_head):
        """attention(xp, q, k, v, mask, scale, kv_head) (the reference's: -> out [T, H*Hd], kq, probs) on groups of
        whole KV heads, one a thread -> out only (the scores and probabilities of each group are dropped)."""
        t, h, hd = q.shape
        kv = k.shape[1]
        parts = min(self.threads, kv)
        if parts == 1:
            return attention(xp, q, k, v, mask, scale, kv_head)[0]
        g = h // kv
        bounds = [kv * i // parts for i in range(parts + 1)]
        out = np.empty((t, h, hd), dtype=np.float32)

        def one(i):
            k0, k1 = bounds[i], bounds[i + 1]
            part = attention(xp, q[:, k0 * g:k1 * g], k[:, k0:k1], v[:, k0:k1], mask, scale,
                             kv_head[k0 * g:k1 * g] - k0)[0]
            out[:, k0 * g:k1 * g] = part.reshape(t, (k1 - k0) * g, hd)
        self.run(one, parts)
        return out.reshape(t, h * hd)


SPLIT = CpuSplit()          # the numba backend's (configured by it: BLAS's thread count is per process too)
