"""One-token products streaming ~1 GB of blocks from memory, per type: GB/s of blocks read, numba exact kernels
(KernelBlocks) and numba-ggml ones (GgmlKernelMatrix / GgmlKQuantMatrix), 2 threads, best of 3 passes."""
import time, numpy as np
import llorch_ref.backends.numba_backend as NB
from llorch_ref.testing.blocks import random_qtensor
from llorch_ref.model.qtensor import block_size
NB.NumbaBackend(threads=2)
import os
QTS = os.environ.get("BW_TYPES", "Q4_0,Q4_K,Q5_K,Q6_K,Q8_0").split(",")
x = np.random.default_rng(0).standard_normal((1, 4096)).astype(np.float32)
for qt in QTS:
    per, size = block_size(qt)
    n = int(1e9 // (4096 // per * size * 11008)) + 1
    qts = [random_qtensor(qt, 11008, 4096, i) for i in range(n)]
    gb = sum(q.blocks.nbytes for q in qts) / 1e9
    res = []
    for kind, make in (("exact", lambda q: NB.KernelBlocks([q])),
                       ("ggml", lambda q: (NB.GgmlKQuantMatrix if qt.endswith("_K") else NB.GgmlKernelMatrix)(q))):
        ms = [make(q) for q in qts]
        ms[0].matmul(x)
        best = 1e9
        for _ in range(3):
            t = time.perf_counter()
            for m in ms:
                m.matmul(x)
            best = min(best, time.perf_counter() - t)
        res.append(f"{kind} {gb / best:.1f} GB/s")
    print(f"{qt}: {gb:.2f} GB of blocks: " + ", ".join(res), flush=True)
