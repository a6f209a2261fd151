"""The llama.cpp build whose arithmetic numerics "ggml" reproduces: the installed llama-cpp-python's CPU features and
the vector width they give (ggml_cpu.SIMD_LANES: an AVX2 build sums float32 products in 8 lanes, AVX-512 in 16)."""
from __future__ import annotations

import ctypes
import importlib.util
import os
import re
import sys
from pathlib import Path


def installed_build_features() -> list[str] | None:
    """The CPU features the installed llama-cpp-python's build uses, read from llama_print_system_info ("CPU : SSE3
    = 1 | AVX2 = 1 | ... |"), or None when it is not installed or its shared library fails to load.
    A portable wheel is built for one level (the shared wheel: AVX2), a native build for its CPU (AVX-512 where the
    CPU has it), whatever CPU runs it. On Linux the library llama_cpp would load is called directly (importing
    llama_cpp, which imports its chat formats and jinja2, cost --numerics ggml's load 30-60 ms); elsewhere, or where
    that library is not where llama_cpp keeps it, through llama_cpp."""
    path = _library_path()
    if path is None:
        return _features_through_llama_cpp()
    try:
        fn = ctypes.CDLL(str(path)).llama_print_system_info
    except (OSError, AttributeError):      # a library that does not load: llama_cpp's import fails the same way
        return None
    fn.restype = ctypes.c_char_p
    return _features(fn().decode(errors="replace"))


def _library_path() -> Path | None:
    """The libllama llama_cpp loads (its package's lib/ folder, or LLAMA_CPP_LIB_PATH), found without importing
    llama_cpp; None off Linux, when llama_cpp is not installed, or when that file is absent."""
    if not sys.platform.startswith("linux"):
        return None
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or spec.origin is None:
        return None
    base = os.environ.get("LLAMA_CPP_LIB_PATH") or Path(spec.origin).parent / "lib"
    path = Path(base) / "libllama.so"
    return path if path.is_file() else None


def _features_through_llama_cpp() -> list[str] | None:
    try:
        import llama_cpp
    except Exception:         # not installed, or its library fails to load (llama_cpp raises RuntimeError then)
        return None
    return _features(llama_cpp.llama_print_system_info().decode(errors="replace"))


def _features(info: str) -> list[str]:
    cpu = info.split("CPU :", 1)[1] if "CPU :" in info else info
    return [m.group(1) for m in re.finditer(r"(\w+) = 1\b", cpu.split(";")[0])]


def simd_of(features) -> str:
    """A build's CPU features -> "avx512" when it uses AVX-512, else "avx2"."""
    return "avx512" if any(f.startswith("AVX512") for f in features) else "avx2"


def installed_simd() -> str | None:
    """The installed llama-cpp-python build's width ("avx2" or "avx512"), or None when it is not installed."""
    features = installed_build_features()
    return None if features is None else simd_of(features)
