"""Several-token products and attention on the CPU when other processes hold cores: split over llorch-ref's own
threads, each part one single-threaded BLAS call.

OpenBLAS's own threads divide a product statically and spin while they wait for each other; on a machine where
other processes hold the cores, a thread the scheduler parks holds the whole product back (the default model's
prefill at 2 threads with both cores busy: 74 tok/s, runs from 26 to 148). Split here, the waits sleep and a
parked thread delays only its own part: 157-185 tok/s, runs from 140 to 319 (results/cpu/busy-cores.md). On
free cores OpenBLAS's spinning threads are faster (each hand-off to a sleeping thread costs a wake-up, about 20%
of the default model's prefill), so the split is taken only while the machine is busy: every 0.2 s at most the
cores other processes used since the last look are read from /proc/stat (the machine's busy time less this
process's own), and at 0.5 cores or more the split is on and BLAS runs on one thread, else BLAS gets the threads.
The numpy backend (the oracle) takes only the look: BLAS on one thread for its one-token steps while the cores are
busy, never a split, so that its results do not follow the load (backends/__init__.NumpyBackend). The numba backend
also runs its one-token steps on no more of its own threads than the cores the others leave, once they have held
them at two measures running (spare_threads). A measure after a window in which this process sat idle (between
requests, between a bench's rounds) does not count what the others did then.
A product is cut into row panels of the weight and attention into groups of query heads, one part a thread (the
calling thread takes the first). Each output element comes from a BLAS call of the same operands either way, but
not always from the same kernel: OpenBLAS picks its kernel by the call's shape, and a panel can fall under its
small-matrix kernels where the whole product does not. On the tests' shapes the results are equal to the bit
with OpenBLAS's SkylakeX kernels (tests/test_backends.py), not with its Haswell kernels (a machine's
OPENBLAS_CORETYPE=Haswell: 118 of 1000 columns differ in their last bits; OpenBLAS's own threads differ too); on a
2-core AVX-512 Xeon (OpenBLAS 0.3.31, SkylakeX kernels) the default model's prompt of 4 tokens gave Q/K/V products
differing by up to 1.7e-6 and logits by up to 2.7e-5 between the two ways: on a machine whose load changes, the
prompt's logits can move by as much.
"""
from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ..errors import ParameterError
from .settings import BLAS_SPLIT_MODES, settings

BUSY_CORES = 0.5        # other processes' use of the cores at which the split goes on
LOOK_EVERY_S = 0.2
STALE_S, IDLE_CORES = 0.5, 0.25  # a window longer than STALE_S in which this process used under IDLE_CORES: stale
SPLIT_SCORES = 4096     # attention split from this many scores a head (T x positions); fewer cost less than the pool


def machine_busy_s():
    """-> the seconds of CPU time the whole machine has spent busy since boot (/proc/stat), or None."""
    try:
        with open("/proc/stat") as f:
            v = [int(a) for a in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return (sum(v[:8]) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")      # less idle and iowait; guest time is in user


def usable_cores() -> int:
    """The cores this process may run on (its affinity), else the machine's."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def spare_cores(threads: int) -> float:
    """Cores this process may use, less its threads and the machine's load (1-minute average): what other
    processes could still have if this one's threads spun while waiting."""
    cores = usable_cores()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float(cores)
    return cores - threads - load


def blas_controller():
    """threadpoolctl's controller of the BLAS libraries in this process (CpuSplit sets their thread count)."""
    from threadpoolctl import ThreadpoolController
    return ThreadpoolController().select(user_api="blas")


class CpuSplit:
    """run(fn, parts), product(x, w), attention_out(attention, ...) over `threads` threads (1: in the caller);
    `split` says whether the last look found the cores busy (then products and attention are split and BLAS runs on
    one thread), `mode` forces it ("split", "blas"; default "auto")."""

    def __init__(self, threads: int = 1, mode: str = "auto"):
        self.threads, self.pool, self.mode, self.split = 1, None, mode, False
        self.blas, self._last, self.others, self.busy_looks = None, None, 0.0, 0
        self.configure(threads, mode=mode)

    def configure(self, threads: int, blas=None, mode=None):
        """threads: this process's threads; blas: threadpoolctl's controller of the BLAS libraries (its thread
        count set to `threads`, or 1 while split), None: leave BLAS alone; mode: "auto", "split" or "blas"
        (default: settings' blas_split, $LLORCH_BLAS_SPLIT)."""
        mode = mode or settings().blas_split
        if mode not in BLAS_SPLIT_MODES:
            raise ParameterError(f"blas split mode {mode!r} must be auto, split or blas")
        self.mode = mode
        if threads != self.threads:
            if self.pool is not None:
                self.pool.shutdown(wait=True)
            self.threads = threads
            self.pool = ThreadPoolExecutor(threads - 1, thread_name_prefix="llorch-split") if threads > 1 else None
        self.blas, self._last, self.split = blas, None, None         # None: BLAS's thread count not set yet
        self.others, self.busy_looks = 0.0, 0
        self._set(self.mode == "split")

    def _set(self, split: bool):
        split = split and self.threads > 1
        if self.blas is not None and split != self.split:
            self.blas.limit(limits=1 if split else self.threads)
        self.split = split

    def look(self):
        """measure(); in mode auto, split while the others use BUSY_CORES or more."""
        if self.measure() and self.mode == "auto":
            self._set(self.others >= BUSY_CORES)

    def measure(self) -> bool:
        """The cores other processes used since the last measure (at most every LOOK_EVERY_S) -> self.others;
        -> whether it measured."""
        if self.threads == 1:
            return False
        now = time.monotonic()
        if self._last is not None and now - self._last[0] < LOOK_EVERY_S:
            return False
        busy, own = machine_busy_s(), sum(os.times()[:2])
        if busy is None:
            return False
        last, self._last = self._last, (now, busy, own)
        if last is None:
            return False
        gap, own_used = now - last[0], own - last[2]
        # a process that sat idle through the window (between requests, between a bench's rounds) would learn what
        # the others did then, not now: free cores until the next measure
        idle = gap > STALE_S and own_used < IDLE_CORES * gap
        self.others = 0.0 if idle else max(0.0, (busy - last[1] - own_used) / gap)
        self.busy_looks = self.busy_looks + 1 if self.others >= BUSY_CORES else 0
        return True

    def spare_threads(self, threads: int) -> int:
        """Of `threads`, those worth running now: all unless other processes used BUSY_CORES or more at the last two
        measures (a process that holds a core; threads that spin a moment after their own work, as another engine's
        after its turn in bench --interleave, do not last), else no more than the cores they leave (at least one)."""
        if self.busy_looks < 2:
            return threads
        return max(1, min(threads, int(usable_cores() - self.others + 0.5)))

    def prefer_split(self):
        """Split this forward's work, BLAS on one thread, unless mode "blas" forbids it: for a caller whose own
        kernels take every core between its BLAS calls (numba's prompts on the blocks), where BLAS's threads,
        spinning after each call, held a core against them (a 96-token prompt at half the speed of 80)."""
        if self.mode != "blas":
            self._set(True)

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
        """x: [T, K] f32, w: [N, K] f32 -> x @ w.T [T, N] f32: split, one row panel of w a thread."""
        self.look()
        n = w.shape[0]
        parts = max(1, min(self.threads, n // 64)) if self.split else 1
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
        query heads as even as the heads allow, one a thread (each head reads its KV head as kv_head says; a head's
        products are the same whichever group it is in) -> out only (the scores and probabilities are dropped).
        Groups of whole KV heads were uneven where the KV heads do not divide among the threads (the default
        model's 3 over 2 threads: 6 query heads against 3)."""
        t, h, hd = q.shape
        parts = min(self.threads, h) if self.split and t * k.shape[0] >= SPLIT_SCORES else 1
        if parts == 1:
            return attention(xp, q, k, v, mask, scale, kv_head)[0]
        bounds = [h * i // parts for i in range(parts + 1)]
        out = np.empty((t, h, hd), dtype=np.float32)

        def one(i):
            h0, h1 = bounds[i], bounds[i + 1]
            out[:, h0:h1] = attention(xp, q[:, h0:h1], k, v, mask, scale, kv_head[h0:h1])[0].reshape(t, h1 - h0, hd)
        self.run(one, parts)
        return out.reshape(t, h * hd)


SPLIT = CpuSplit()          # the numpy and numba backends' (configured by them: BLAS's thread count is per process too)
