"""The all-type kernel (matmul_rows, the type code a runtime value) against the one made for the type (the code a
constant), products of six 4096 x 4096 matrices (about 60 MB: from DRAM) at 1, 8 and 64 tokens, best of 7, the two
alternating: python one_type_products.py Q4_K,Q6_K,..."""
import sys, time, numpy as np
import llorch_ref.backends.numba_backend as NB
from llorch_ref.testing.blocks import random_qtensor
K, S = NB.K, NB.S
NB.NumbaBackend(threads=2)
rng = np.random.default_rng(0)
for qt in sys.argv[1].split(","):
    qs = [random_qtensor(qt, 4096, 4096, i) for i in range(6)]          # ~60 MB of Q4_K blocks: from DRAM
    rows = [NB.row_addresses([q]) for q in qs]
    code, nb_ = S.TYPE_CODE[qt], 4096 // S.BLOCKS[qt][0]
    one = K._one_type(code)         # the kernel made for the one type (matmul_rows_for keeps Q4_K on the all-type one)
    for T in (1, 8, 64):
        x = rng.standard_normal((T, 4096)).astype(np.float32)
        out = np.empty((T, 4096), np.float32)
        res = {}
        for name, f in (("all-type", lambda r: K.matmul_rows(code, r, nb_, x, out)), ("one-type", lambda r: one(r, nb_, x, out))):
            f(rows[0])
        best = {"all-type": 1e9, "one-type": 1e9}
        for rep in range(7):
            pair = (("all-type", lambda r: K.matmul_rows(code, r, nb_, x, out)), ("one-type", lambda r: one(r, nb_, x, out)))
            for name, f in (pair if rep % 2 else pair[::-1]):
                t = time.perf_counter()
                for r in rows:
                    f(r)
                best[name] = min(best[name], time.perf_counter() - t)
        print(f"{qt} T={T}: all-type {best['all-type']*1e3:.1f} ms, one-type {best['one-type']*1e3:.1f} ms, ratio {best['all-type']/best['one-type']:.3f}", flush=True)
