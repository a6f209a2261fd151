"""A 128-token forward of the default model, this tree's kernels against a base commit's, in one process, alternating."""
import sys, time, importlib, tempfile, statistics
from functools import partial
from pathlib import Path
import numpy as np
sys.path.insert(0, str(Path(__file__).resolve().parent)); sys.path.insert(0, "/work/main/tools")
import kernel_ab
import llorch_ref
from llorch_ref.backends.numba_backend import KernelBlocks
model = sys.argv[2] if len(sys.argv) > 2 else None
e = llorch_ref.load(model, backend="numba", threads=2)
import gc
kbs = [o for o in gc.get_objects() if isinstance(o, KernelBlocks)]
with tempfile.TemporaryDirectory() as tmp:
    sys.path.insert(0, tmp)
    base = importlib.import_module(f"{kernel_ab.base_package(sys.argv[1], Path(tmp))}.numba_kernels")
    here = {id(kb): kb.kernel for kb in kbs}
    there = {id(kb): partial(base.matmul_rows, kb.code) for kb in kbs}
    ids = e.tokenizer.encode("The history of the world is long and full of surprises. " * 12)[:128]
    def run(kern):
        for kb in kbs: kb.kernel = kern[id(kb)]
        t = time.perf_counter(); e.forward(ids, e.new_cache(), rows=[127]); return time.perf_counter() - t
    for k in (here, there): run(k); run(k)
    a, b = [], []
    for r in range(15):
        for k, acc in ((here, a), (there, b)) if r % 2 == 0 else ((there, b), (here, a)):
            acc.append(run(k))
    ra = [y / x for x, y in zip(a, b)]
    print(f"{len(kbs)} kernel matrices; this {128/statistics.median(a):.1f} tok/s, base {128/statistics.median(b):.1f} tok/s; this/base {statistics.median(ra):.3f} (rounds {min(ra):.2f}-{max(ra):.2f})")
