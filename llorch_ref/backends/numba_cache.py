"""numba's on-disk cache of the kernels, kept true to every source file the kernels are built from.

numba keys a cached function on its own file (a hash of its contents; its mtime and size in older releases):
numba_kernels.py's functions are built from numba_simd.py's intrinsics, and numba_ggml.py's from both, so an edit to
numba_simd.py alone, or an upgrade that changes only it (pip leaves __pycache__'s .nbi/.nbc files in place), would load the
kernels compiled from the old code. `install()` puts, ahead of numba's own cache locators, the same locators with
a stamp that also covers the contents of every kernel source file (KERNEL_SOURCES): any change to one of them
recompiles every cached kernel. Call it before the kernel modules' functions are decorated.
"""
from __future__ import annotations

import hashlib
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


def install() -> bool:
    """Put the stamped locators first (once) -> whether numba's locator list was found (a test checks it is)."""
    from numba.core import caching

    impl = getattr(caching, "CacheImpl", None) or getattr(caching, "_CacheImpl", None)     # newer / older numba
    classes = getattr(impl, "_locator_classes", None)
    if classes is None:
        return False
    if not any(issubclass(c, _KernelStamp) for c in classes):
        bases = [caching.UserProvidedCacheLocator, caching.InTreeCacheLocator, caching.UserWideCacheLocator]
        classes[:0] = [type(f"Kernel{b.__name__}", (_KernelStamp, b), {}) for b in bases]
    return True
