"""this tree's matmul_rows vs a base commit's, shapes NxK, tokens, threads: python ab2.py BASE TYPES SHAPES TOKENS THREADS"""
import sys, importlib, tempfile
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent))
import numpy as np, numba as nb
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import kernel_ab
from llorch_ref.backends import numba_kernels as here
from llorch_ref.backends.numba_backend import KernelBlocks
from llorch_ref.testing.blocks import random_qtensor
base_c, types_, shapes, toks, threads = sys.argv[1:6]
with tempfile.TemporaryDirectory() as tmp:
    sys.path.insert(0, tmp)
    here_base = Path(__file__).resolve().parent / "base"
    if here_base.is_dir():                  # the base's files carried (no git where it runs)
        import shutil
        pkg = Path(tmp) / "kernels_base"
        shutil.copytree(here_base, pkg)
        (pkg / "__init__.py").write_text("from llorch_ref.backends import numba_wide_vectors  # noqa: F401\n")
        base = importlib.import_module("kernels_base.numba_kernels")
    else:
        base = importlib.import_module(f"{kernel_ab.base_package(base_c, Path(tmp))}.numba_kernels")
    rng = np.random.default_rng(0)
    for th in map(int, threads.split(",")):
        nb.set_num_threads(th)
        for q in types_.split(","):
            for s in shapes.split(","):
                n, k = map(int, s.split("x"))
                kb = KernelBlocks([random_qtensor(q, n, k, 1)])
                for t in map(int, toks.split(",")):
                    x = rng.standard_normal((t, k)).astype(np.float32)
                    calls = max(2, int(1e8 // (n * k * t)))
                    print(s, kernel_ab.compare(q, kb.code, kb.rows, kb.n_blocks, x, {"this": here, "base": base}, th, rounds=9, calls=calls), flush=True)
