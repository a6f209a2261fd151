"""numba's on-disk cache of the kernels, kept true to every source file the kernels are built from.

numba keys a cached function on its own file (a hash of its contents; its mtime and size in older releases):
numba_kernels.py's functions are built from numba_simd.py's intrinsics, and numba_ggml.py's from both, so an edit to
numba_simd.py alone, or an upgrade that changes only it (pip leaves __pycache__'s .nbi/.nbc files in place), would load the
kernels compiled from the old code. `install()` puts, ahead of numba's own cache locators, the same locators with
a stamp that also covers the contents of every kernel source file (KERNEL_SOURCES): any change to one of them
recompiles every cached kernel. Call it before the kernel modules' functions are decorated.

Loading a cached kernel: numba refreshes its target context first, which imports and installs every lowering
registry it has (linalg, random, typed containers, ...: 0.2-0.3 s, a fifth of the default model's load). Those are
needed to compile, and numba's compiler refreshes before it compiles; loaded machine code needs numba's runtime
(NRT) only. The stamped kernels' cache loads therefore start the runtime (its helpers' machine code cached too:
`start_runtime`) and numba's threads (`start_threads`), and skip the refresh (`install`);
every other function's cache loads as numba's does.
"""
from __future__ import annotations

import hashlib
import os
import pickle
from pathlib import Path

HERE = Path(__file__).resolve().parent
KERNEL_SOURCES = ("numba_simd.py", "numba_kernels.py", "numba_ggml.py")


def sources_digest(folder: Path = HERE) -> str:
    """sha256 over the kernel source files' contents, in KERNEL_SOURCES' order."""
    h = hashlib.sha256()
    for name in KERNEL_SOURCES:
        h.update(name.encode() + b"\0" + (folder / name).read_bytes() + b"\0")
    return h.hexdigest()


class _KernelStamp:
    """A cache-locator mixin: claims only the functions of this folder, stamped with sources_digest() as well."""

    @classmethod
    def from_function(cls, py_func, py_file):
        if Path(py_file).resolve().parent != HERE:
            return None
        return super().from_function(py_func, py_file)

    def get_source_stamp(self):
        return (super().get_source_stamp(), _DIGEST)


_DIGEST = sources_digest()


def _loader(numba_load):
    """Cache.load_overload for the stamped kernels: the runtime started (its helpers' machine code cached beside
    the kernels': start_runtime), the context's registries left unloaded."""

    def load_overload(self, sig, target_context):
        if not isinstance(self._impl.locator, _KernelStamp):
            return numba_load(self, sig, target_context)
        start_runtime(target_context, Path(self._impl.locator.get_cache_path()))
        start_threads()
        return self._load_overload(sig, target_context)
    load_overload.numba_load = numba_load
    return load_overload


def start_threads():
    """Start numba's threading layer, as numba does when it loads a parallel function from its cache (its parfors'
    reload hook). A kernel compiled over a parallel callee that came from the cache (matmul_rows over _rows_times,
    compiled in another process) does not carry that hook (numba issue 8578): loaded from the cache into a process
    whose threads nothing had started, its first parallel region segfaulted. Idempotent."""
    from numba.np.ufunc.parallel import _launch_threads

    _launch_threads()


def start_runtime(target_context, folder: Path):
    """Start numba's runtime (NRT), its helper functions' machine code read from `folder` where an earlier process
    left it, else compiled as numba compiles it and left there. numba compiles them with LLVM at every start:
    17-20 ms of the default model's 0.25 s load on Zen 5, the one LLVM optimization a cached start ran. The file
    is keyed by the helpers' IR and numba's codegen (target, CPU, features): any change compiles them afresh, and so
    does an unreadable file. -> whether they came from the file."""
    from numba.core.runtime import nrtdynmod, rtsys

    if getattr(rtsys, "_init", False):
        return False
    compile_nrt, loaded = nrtdynmod.compile_nrt_functions, []

    def cached(ctx):
        try:
            return from_file(ctx)
        except Exception:                   # a numba whose runtime module or library API differs: as numba does
            return compile_nrt(ctx)

    def from_file(ctx):
        ir_mod, library = nrtdynmod.create_nrt_module(ctx)
        codegen = ctx.codegen()
        key = hashlib.sha256(f"{ir_mod}\0{codegen.magic_tuple()}".encode()).hexdigest()[:24]
        path = folder / f"numba-runtime-{key}.pkl"
        try:
            lib = codegen.unserialize_library(pickle.loads(path.read_bytes()))
            loaded.append(lib)
            return lib
        except Exception:                   # absent, unreadable or not numba's: compiled below
            pass
        library.enable_object_caching()
        library.add_ir_module(ir_mod)
        library.finalize()
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        try:
            tmp.write_bytes(pickle.dumps(library.serialize_using_object_code()))
            os.replace(tmp, path)
        except OSError:                     # a read-only or full cache folder: compiled at each start, as numba does
            tmp.unlink(missing_ok=True)
        return library

    nrtdynmod.compile_nrt_functions = cached
    try:
        rtsys.initialize(target_context)
    finally:
        nrtdynmod.compile_nrt_functions = compile_nrt
    return bool(loaded)


def install() -> bool:
    """Put the stamped locators first and their loader in (once) -> whether numba's locator list was found (a test
    checks it is). The loader is only a speed-up: a numba whose Cache has no _load_overload keeps its own."""
    from numba.core import caching

    impl = getattr(caching, "CacheImpl", None) or getattr(caching, "_CacheImpl", None)     # newer / older numba
    classes = getattr(impl, "_locator_classes", None)
    if classes is None:
        return False
    if not any(issubclass(c, _KernelStamp) for c in classes):
        bases = [caching.UserProvidedCacheLocator, caching.InTreeCacheLocator, caching.UserWideCacheLocator]
        classes[:0] = [type(f"Kernel{b.__name__}", (_KernelStamp, b), {}) for b in bases]
    cache = getattr(caching, "Cache", None)
    if hasattr(cache, "_load_overload") and not hasattr(cache.load_overload, "numba_load"):
        cache.load_overload = _loader(cache.load_overload)
    return True
