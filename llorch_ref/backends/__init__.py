"""Backends: an array module `xp`, conversions, and the few kernels a backend overrides.

numpy  the oracle: the layer functions of llorch_ref.model.layers as they are.
numba  CPU kernels on the GGUF quantized blocks for matrix-vector products (decode), compiled with
       fastmath off, a fixed thread count and the compile cache on (llorch_ref.backends.numba_kernels).
cupy   the whole forward on an NVIDIA GPU: weights uploaded once, float32 (TF32 off) or float16 weights.
"""
from __future__ import annotations

import functools
import os
import platform
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ..errors import ParameterError
from ..model import forward as forward_mod
from .cpu_split import SPLIT, blas_controller, usable_cores

BACKENDS = ("numpy", "numba", "cupy")


def _cpuinfo(key: str) -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(key):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_model() -> str:
    """The CPU's model name (named beside every speed figure)."""
    return _cpuinfo("model name") or platform.processor() or "unknown"


def cpu_flags() -> str:
    """The SIMD flags that change kernels (and the low bits of results)."""
    flags = set((_cpuinfo("flags") or "").split())
    keep = ["sse3", "ssse3", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
            "avx_vnni", "amx_tile"]
    return " ".join(f for f in keep if f in flags) or platform.processor()


def numpys_blas(libs: list) -> dict:
    """Of threadpoolctl's BLAS entries, the one numpy's products run on: the library that numpy's wheel carries
    (numpy.libs, or inside numpy), else the first loaded. A process can hold several: on the GPU host's Python
    (scipy installed, which numba imports) some runs listed another OpenBLAS (0.3.31.dev) before numpy's 0.3.34."""
    import numpy

    home = os.path.dirname(numpy.__file__)
    return next((x for x in libs if str(x.get("filepath", "")).startswith((home + os.sep, home + ".libs"))), libs[0])


def blas_info() -> str:
    """The BLAS numpy runs on (the prefill's products), its kernel set and threads, in one line for reports; says
    when OPENBLAS_CORETYPE chose the kernels (a machine that sets OPENBLAS_CORETYPE=Haswell gives an AVX-512 CPU
    256-bit kernels: 0.7x OpenBLAS's own choice on AMD EPYC Zen 5's float32 products)."""
    try:
        from threadpoolctl import threadpool_info
        libs = [x for x in threadpool_info() if x.get("user_api") == "blas"]
    except Exception as e:          # threadpoolctl missing or failing: say so rather than guess
        return f"unknown (threadpoolctl: {e})"
    if not libs:
        return "none found"
    b = numpys_blas(libs)
    forced = os.environ.get("OPENBLAS_CORETYPE") if b.get("internal_api") == "openblas" else None
    return (f"{b.get('internal_api')} {b.get('version')}, {b.get('architecture')} kernels"
            + (f" (chosen by OPENBLAS_CORETYPE={forced} in the environment)" if forced else "")
            + f", {b.get('num_threads')} threads")


@dataclass
class Backend:
    name: str
    xp: Any
    asarray: Callable
    to_numpy: Callable
    device: str
    dtype: str = "float32"               # storage type of the 2-D weights on this backend
    info: dict = field(default_factory=dict)

    def make_ops(self, base_ops):
        """-> the layer-function namespace for this backend (base_ops with hot kernels overridden)."""
        return base_ops

    def make_ggml_ops(self, ggml_ops):
        """-> numerics "ggml"'s namespace for this backend (ggml_cpu.make_ops's, with kernels that compute the same
        bits faster where the backend has them)."""
        return ggml_ops

    def prepare_weights(self, weights, qtensors=None, numerics="exact"):
        """-> the weights as this backend computes with them. qtensors: the GGUF loader's quantized matrices
        ((layer, field) or "output" -> QTensor), for kernels that multiply by the blocks (numba); numerics: "exact" or "ggml" (matrix objects that stay as they are)."""
        return weights.map(self.asarray)

    def forward(self, xp, cfg, weights, tokens, cache, ops, rows=None, boundary=None):
        """The forward pass where no recorder looks at tensors (boundary: a recorder of the layer boundaries only,
        or None) -> logits [R, V]: the reference's here; a backend that fuses operations runs its own
        (fused_forward.forward)."""
        kw = {"record": boundary} if boundary is not None else {}
        return forward_mod.forward(xp, cfg, weights, tokens, cache, rows=rows, ops=ops, **kw)

    def synchronize(self):
        pass

    def before_forward(self, n_tokens):
        """Called before every forward pass of n_tokens tokens: a CPU backend may look at the machine's load."""

    def argmax(self, logits) -> int:
        """logits: [V] on this backend -> the index of the highest (the first on ties and NaN, as np.argmax)."""
        return int(np.argmax(self.to_numpy(logits)))

    def cache_class(self, base_cls):
        """The Cache class this backend uses (cupy: device-side positions for captured decode steps)."""
        return base_cls

    def make_decoder(self, engine, cache):
        """-> decode(token_id) -> logits [1, V]: one single-token step (cupy: a replayed CUDA graph)."""
        return lambda token: engine.forward([token], cache, rows=[0])


def numba_wide_vectors():
    """On a CPU with AVX-512, let numba's LLVM use 512-bit vectors: its host tuning prefers 256-bit ones
    (`prefer-256-bit`), which left the decode kernels at 0.55x llama.cpp where zmm registers give 0.75-0.79x
    (results/cpu/avx512-vectors.md). Set through NUMBA_CPU_FEATURES before numba is first imported; a value the
    user set is kept, and a numba already imported keeps its own."""
    if "NUMBA_CPU_FEATURES" in os.environ or "numba" in sys.modules or "avx512f" not in cpu_flags().split():
        return
    try:
        import llvmlite.binding as ll
        ll.initialize_native_target()
        os.environ["NUMBA_CPU_FEATURES"] = ll.get_host_cpu_features().flatten() + ",-prefer-256-bit"
    except Exception:           # llvmlite missing or unable to read the host: numba's own defaults
        pass


def available(names=None) -> dict:
    """name -> None if usable here, else the reason it is not; names: the backends to probe (default all). Only
    those are probed: cupy's import and CUDA's device count were part of every numba load where cupy is installed
    (the GPU host, whose numba loads took 0.95-1.51 s against 0.22-0.29 s here; not timed apart there)."""
    names = BACKENDS if names is None else names
    out = {"numpy": None} if "numpy" in names else {}
    if "numba" in names:
        numba_wide_vectors()
        try:
            import numba  # noqa: F401
            out["numba"] = None
        except ImportError as e:
            out["numba"] = f"numba is not installed ({e}); pip install 'llorch-ref[numba]'"
    if "cupy" in names:
        out["cupy"] = _cupy_reason()
    return out


def _cupy_reason():
    need = "the cupy backend needs an NVIDIA GPU with a CUDA 12 driver and pip install 'llorch-ref[cupy]'"
    try:
        import cupy
    except ImportError:
        return f"cupy is not installed; {need}"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
        return None if n > 0 else f"no CUDA device found; {need}"
    except Exception as e:  # CUDARuntimeError: no driver, no device
        return f"no usable CUDA device ({type(e).__name__}: {e}".splitlines()[0] + f"); {need}"


def backend_name(name: str | None = None) -> str:
    """The backend a run uses: the one named, else $LLORCH_BACKEND, else numpy (read here only)."""
    return name or os.environ.get("LLORCH_BACKEND") or "numpy"


_BLAS_LIMIT = []      # the threadpoolctl limit in force (kept alive: dropping it would not undo it, but keep it)


def cpu_threads(threads=None) -> int:
    """The thread count of a CPU backend: --threads, else $LLORCH_THREADS, else the cores this process may use."""
    n = threads if threads is not None else os.environ.get("LLORCH_THREADS")      # 0 is refused, not "all cores"
    if n is None:
        n = usable_cores()
    n = int(n)
    if n < 1:
        raise ParameterError(f"threads={n} must be >= 1")
    return n


@functools.lru_cache(maxsize=None)
def l2_bytes() -> int:
    """A core's L2 cache in bytes, as Linux reports it for CPU 0; 1 MiB where that cannot be read."""
    for d in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            if (d / "level").read_text().strip() == "2" and (d / "type").read_text().strip() != "Instruction":
                size = (d / "size").read_text().strip().upper()          # "1024K", "2048K", "2M"
                return int(size.rstrip("KM")) << (20 if size.endswith("M") else 10 if size.endswith("K") else 0)
        except (OSError, ValueError):
            pass
    return 1 << 20


def limit_blas(threads: int) -> dict:
    """Every BLAS library loaded in this process (OpenBLAS, MKL under NumPy) to `threads` threads, through
    threadpoolctl; -> {library: threads} as it now stands."""
    from threadpoolctl import threadpool_info, threadpool_limits

    _BLAS_LIMIT[:] = [threadpool_limits(limits=threads, user_api="blas")]
    return {i["internal_api"]: i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"}


class NumpyBackend(Backend):
    """The oracle: the layer functions as they are (ops stay the model.layers module, so that a planted bug in one
    reaches every run). With both cores busy at two threads OpenBLAS's spinning threads wait on parked ones and a
    multi-threaded one-token step runs tens of times slower: before each one-token step it looks at the machine's
    load (cpu_split's look) and runs BLAS on one thread while other processes hold the cores (its decode then 2.02x
    slower with both cores busy: results/cpu/zen5/busy-cores.md). One row's product has the same bits on one BLAS
    thread and on two (OpenBLAS's Haswell and SkylakeX kernels; tests/test_backends.py checks it on the machine's);
    eight rows' do not under the Haswell kernels, so a prompt keeps the threads asked for: the oracle's results do
    not follow the load; with both cores of 2 busy its 64-token prompt can run 55-65x slower (OpenBLAS's threads
    waiting on each other), so while other processes hold cores at two measures running it says once, on stderr,
    that --threads 1 avoids it. `LLORCH_BLAS_SPLIT=blas` keeps BLAS's threads for every step. The last backend
    configured in a process governs cpu_split (a numba engine loaded after a numpy one splits its own products)."""

    def __init__(self, threads=None):
        n = cpu_threads(threads)
        blas = limit_blas(n)
        SPLIT.configure(n)                    # its look only: this backend sets BLAS's threads itself
        self._blas, self._one, self._warned = blas_controller(), False, False
        super().__init__("numpy", np, lambda a: a, lambda a: a, "cpu",
                         info={"threads": n, "blas": blas, "blas_split": SPLIT.mode})

    def before_forward(self, n_tokens):
        SPLIT.look()
        one = SPLIT.split and n_tokens == 1
        if one != self._one:
            self._blas.limit(limits=1 if one else self.info["threads"])
            self._one = one
        if n_tokens > 1 and not one and SPLIT.busy_looks >= 2 and self.info["threads"] > 1 and not self._warned:
            self._warned = True
            print(f"llorch-ref: warning: other processes hold this machine's cores; the numpy backend's prompts keep "
                  f"their {self.info['threads']} BLAS threads (its results do not follow the load), which can run "
                  "them 50x slower here (OpenBLAS's threads wait on each other); --threads 1 avoids it",
                  file=sys.stderr)


def get_backend(name=None, dtype: str = "float32", threads: int | None = None) -> Backend:
    name = backend_name(name)
    if name not in BACKENDS:
        raise ParameterError(f"backend {name!r} is not one of {', '.join(BACKENDS)}")
    if dtype not in ("float32", "float16", "blocks"):
        raise ParameterError(f"dtype {dtype!r} must be float32, float16 or blocks")
    if dtype == "blocks" and name != "cupy":
        raise ParameterError("dtype 'blocks' (quantized matrices multiplied as the file's blocks) is the cupy "
                             "backend's; the numba backend multiplies by the blocks at --dtype float32 already")
    if name == "numpy":
        if dtype != "float32":
            raise ParameterError("the numpy backend computes in float32 only (it is the oracle)")
        return NumpyBackend(threads)
    reason = available((name,))[name]
    if reason:
        raise ParameterError(f"backend {name!r} is not available: {reason}")
    if name == "numba":
        from .numba_backend import NumbaBackend
        if dtype != "float32":
            raise ParameterError("the numba backend computes in float32 only")
        return NumbaBackend(threads)
    from .cupy_backend import CupyBackend
    return CupyBackend(dtype)
