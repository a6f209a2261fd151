import time, numpy as np
from llorch_ref.testing.blocks import random_qtensor
from llorch_ref.backends.numba_backend import GgmlKQuantMatrix
from llorch_ref.backends import numba_ggml as G, numba_simd as S
for qt in ("Q4_K", "Q6_K"):
    m = GgmlKQuantMatrix(random_qtensor(qt, 4096, 4096, 1))
    x = np.random.default_rng(0).standard_normal((1, 4096)).astype(np.float32)
    m.matmul(x)
    t = time.perf_counter()
    for _ in range(20): m.matmul(x)
    dt = (time.perf_counter() - t) / 20
    print(qt, f"{dt*1e3:.2f} ms per 4096x4096 product, {dt / (4096*16) * 1e9:.1f} ns per super-block (2 threads)")
