import sys, time, numpy as np, numba as nb
sys.path.insert(0, "/tmp/s28")
import proto
from llorch_ref.backends import numba_kernels as K
from llorch_ref.backends.numba_backend import KernelBlocks
from llorch_ref.testing.blocks import random_qtensor
types_ = sys.argv[1].split(","); shapes = [tuple(map(int, s.split("x"))) for s in sys.argv[2].split(",")]
toks = list(map(int, sys.argv[3].split(","))); threads = list(map(int, sys.argv[4].split(",")))
rng = np.random.default_rng(0)
for th in threads:
    nb.set_num_threads(th)
    for q in types_:
        for (n, k) in shapes:
            kb = KernelBlocks([random_qtensor(q, n, k, 1)])
            for t in toks:
                x = rng.standard_normal((t, k)).astype(np.float32)
                o1 = np.empty((t, n), np.float32); o2 = np.empty((t, n), np.float32)
                K.matmul_rows(kb.code, kb.rows, kb.n_blocks, x, o1); proto.matmul_w(kb.code, kb.rows, kb.n_blocks, x, o2)
                same = np.array_equal(o1, o2)
                calls = max(1, int(2e8 // (n * k * t)))
                ta, tb = [], []
                for rd in range(9):
                    for f, acc in ((K.matmul_rows, ta), (proto.matmul_w, tb)) if rd % 2 == 0 else ((proto.matmul_w, tb), (K.matmul_rows, ta)):
                        o = o1 if f is K.matmul_rows else o2
                        t0 = time.perf_counter()
                        for _ in range(calls): f(kb.code, kb.rows, kb.n_blocks, x, o)
                        acc.append((time.perf_counter() - t0) / calls)
                ta, tb = np.array(ta), np.array(tb)
                gf = lambda s: 2 * n * k * t / np.median(s) / 1e9
                print(f"{q} {n}x{k} T={t} th={th}: old {gf(ta):6.1f} new {gf(tb):6.1f} GFLOP/s new/old {np.median(ta/tb):.2f} ({np.min(ta/tb):.2f}-{np.max(ta/tb):.2f}) {'same bits' if same else 'DIFFER'}", flush=True)
