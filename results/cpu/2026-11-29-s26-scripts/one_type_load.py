"""The default model's two types loaded from numba's cache in a fresh process, after numba's one-time costs: the
all-type kernel (generic) against the two made for Q4_1 and Q8_0: python one_type_load.py generic|Q4_1,Q8_0"""
import sys, time; T = time.perf_counter
import numpy as np
import llorch_ref.backends.numba_backend as NB
K, S = NB.K, NB.S
from numba.core.registry import cpu_target
from numba.core.runtime import rtsys
rtsys.initialize(cpu_target.target_context)
NB.WARM_UP["silu_mul"]()          # one-time codegen start
t = T(); import numba.np.arrayobj; ta = T() - t
x = np.ones((1, 32), np.float32)
blk = np.zeros((1, 64), np.uint8)
row = np.array([blk.ctypes.data], np.int64)
t = T()
if sys.argv[1] == "generic":
    K.matmul_rows(S.TYPE_CODE["Q4_0"], row, 1, x, np.empty((1, 1), np.float32))
else:
    for q in sys.argv[1].split(","):
        K.matmul_rows_for(S.TYPE_CODE[q])(row, 1, x, np.empty((1, 1), np.float32))
print(sys.argv[1], f"arrayobj {ta:.4f} kernel {T() - t:.4f}")
