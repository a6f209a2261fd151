"""A/B of numba's in-place products: this tree's kernels against those of another commit, in one process.

    python tools/kernel_ab.py --base 6042d8f [--types Q4_K,Q5_K,Q6_K] [--tokens 1,8] [--threads 1,2]
    python tools/kernel_ab.py --base 5400f1e --types Q4_1,Q8_0 --shapes 1536x576,576x1536 --tokens 16,128 --threads 2
    python tools/kernel_ab.py --base HEAD --base-set "PANEL_TOKENS=(16, 16)" --types Q4_K --tokens 8,12 --threads 2
    python tools/kernel_ab.py --base kernels/ ...   (a folder holding the base's kernel files: a host without git)

--base-set NAME=VALUE rewrites the base's `NAME = ...` line in numba_simd.py (a constant such as PANEL_TOKENS or
SUPER_ROWS): this tree against a variant of itself.

The host's speed moves by up to 2x within seconds (another VM's work on the same cores), and numba code placed
differently runs up to 10% apart, so separate processes cannot resolve a 10% change. Here the base commit's
numba_simd and numba_kernels are written to a temporary package and imported beside this tree's; both run the
same random blocks (llorch_ref.testing.blocks: finite float16 scales), alternating every 40 calls for 15 rounds, the order swapped every
round. Prints each side's median weight-tokens a second and the median of the per-round ratios (this tree /
base), after checking that both give the same products to the bit; with --reordered (a change of the order of
the sums), the products may differ, and each side's largest error against the float64 product of the
dequantized weights is printed instead.
"""
from __future__ import annotations

import argparse
import importlib
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


KERNEL_FILES = ("numba_simd.py", "numba_kernels.py", "numba_ggml.py", "numba_cache.py")


def base_package(base: str, where: Path, sets=()) -> str:
    """The kernel modules of `base` (a commit of this repository, or a folder holding the files) as package
    `kernels_base` under `where`, each NAME=VALUE of `sets` rewriting numba_simd.py's `NAME = ...` line -> its name."""
    pkg, folder = where / "kernels_base", Path(base)
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from llorch_ref.backends import numba_wide_vectors  # noqa: F401\n")
    for name in KERNEL_FILES:                           # numba_cache.py: not in commits before it came
        if folder.is_dir():
            text = (folder / name).read_text() if (folder / name).is_file() else None
        else:
            try:
                got = subprocess.run(["git", "show", f"{base}:llorch_ref/backends/{name}"], cwd=ROOT,
                                     capture_output=True, text=True)
            except OSError:                             # no git here: a folder is the way
                got = None
            text = got.stdout if got is not None and got.returncode == 0 else None
        if text is not None:
            (pkg / name).write_text(text)
    simd = pkg / "numba_simd.py"
    if not simd.is_file():
        raise SystemExit(f"kernel_ab: --base {base!r} is neither a commit of this repository nor a folder holding "
                         f"numba_simd.py")
    for assign in sets:
        name, eq, value = (part.strip() for part in assign.partition("="))
        if not (eq and name and value):
            raise SystemExit(f"kernel_ab: --base-set {assign!r}: give NAME=VALUE, e.g. 'PANEL_TOKENS=(16, 16)'")
        line = f"{name} = {value}"
        text, n = re.subn(rf"^{re.escape(name)} = .*$", lambda _, line=line: line, simd.read_text(), flags=re.M)
        if n != 1:
            raise SystemExit(f"kernel_ab: --base-set {assign!r}: numba_simd.py needs exactly one line "
                             f"'{name} = ...' (it has {n})")
        simd.write_text(text)
    return "kernels_base"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", required=True, help="the commit to compare against, or a folder of kernel files")
    ap.add_argument("--base-set", action="append", default=[], metavar="NAME=VALUE",
                    help="rewrite the base's numba_simd.py line NAME = ... (repeatable)")
    ap.add_argument("--types", default="Q4_0,Q4_1,Q8_0,Q4_K,Q5_K,Q6_K")
    ap.add_argument("--tokens", default="1,8")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rows", type=int, default=512, help="rows a matrix (K = 4096), where --shapes is not given")
    ap.add_argument("--shapes", default=None,
                    help="matrices as ROWSxK, comma-separated (e.g. 1536x576,576x1536: the default model's gate/up "
                         "and down); each call batch about 1e8 weight-tokens")
    ap.add_argument("--reordered", action="store_true",
                    help="the products may differ in their last bits (another order of the sums): check both "
                         "against the float64 product instead of against each other")
    a = ap.parse_args()
    import numba as nb
    import numpy as np

    from llorch_ref.backends import numba_kernels as here
    from llorch_ref.backends.numba_backend import KernelBlocks
    from llorch_ref.testing.blocks import random_qtensor

    with tempfile.TemporaryDirectory() as tmp:
        sys.path.insert(0, tmp)
        base = importlib.import_module(f"{base_package(a.base, Path(tmp), a.base_set)}.numba_kernels")
        rng = np.random.default_rng(0)
        shapes = [tuple(map(int, s.split("x"))) for s in a.shapes.split(",")] if a.shapes else [(a.rows, 4096)]
        for n, k in shapes:
            qts = {q: random_qtensor(q, n, k, seed) for seed, q in enumerate(a.types.split(","))}
            mats = {q: KernelBlocks([qt]) for q, qt in qts.items()}
            for threads in map(int, a.threads.split(",")):
                nb.set_num_threads(threads)
                for t_n in map(int, a.tokens.split(",")):
                    x = rng.standard_normal((t_n, k)).astype(np.float32)
                    calls = 40 if not a.shapes else max(2, int(1e8 // (n * k * t_n)))
                    for q, kb in mats.items():
                        exact = (x.astype(np.float64) @ qts[q].dequantize().astype(np.float64).T
                                 if a.reordered else None)
                        print(f"{n}x{k}", compare(q, kb.code, kb.rows, kb.n_blocks, x, {"this": here, "base": base},
                                                  threads, calls=calls, exact=exact), flush=True)


def compare(qtype, code, rows, n_blocks, x, sides, threads, rounds=15, calls=40, exact=None):
    import numpy as np

    outs = {}
    for name, mod in sides.items():
        outs[name] = np.empty((x.shape[0], rows.shape[0]), np.float32)
        mod.matmul_rows(code, rows, n_blocks, x, outs[name])
    same = "same products to the bit"
    if exact is not None:
        err = {name: np.abs(o - exact).max() / np.abs(exact).max() for name, o in outs.items()}
        if max(err.values()) > 1e-5:                # float32 sums of 4096 products: about 1e-7 to 1e-6
            return f"{qtype}: products wrong (largest error / largest product: this {err['this']:.2e}, " \
                   f"base {err['base']:.2e})"
        same = (same if np.array_equal(outs["this"], outs["base"]) else "products differ") + \
            f"; largest error / largest product: this {err['this']:.2e}, base {err['base']:.2e}"
    elif not np.array_equal(outs["this"], outs["base"]):
        return f"{qtype}: products differ (max abs {np.abs(outs['this'] - outs['base']).max():.3g})"
    took = {name: [] for name in sides}
    for r in range(rounds):
        for name in (list(sides) if r % 2 == 0 else list(sides)[::-1]):
            f, out = sides[name].matmul_rows, outs[name]
            t0 = time.perf_counter()
            for _ in range(calls):
                f(code, rows, n_blocks, x, out)
            took[name].append((time.perf_counter() - t0) / calls)
    work = rows.shape[0] * x.shape[1] * x.shape[0]
    this, base = np.array(took["this"]), np.array(took["base"])
    return (f"{qtype} T={x.shape[0]} threads={threads}: this {work / np.median(this) / 1e9:6.2f}, base "
            f"{work / np.median(base) / 1e9:6.2f} G weight-tokens/s; this/base {np.median(base / this):.3f} "
            f"(rounds {np.min(base / this):.2f}-{np.max(base / this):.2f}); {same}")


if __name__ == "__main__":
    main()
