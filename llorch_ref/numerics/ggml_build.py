"""The llama.cpp build whose arithmetic numerics "ggml" reproduces: the installed llama-cpp-python's CPU features and
the vector width they give (ggml_cpu.SIMD_LANES: an AVX2 build sums float32 products in 8 lanes, AVX-512 in 16)."""
from __future__ import annotations

import re


def installed_build_features() -> list[str] | None:
    """The CPU features the installed llama-cpp-python's build uses, read from llama_print_system_info ("CPU : SSE3
    = 1 | AVX2 = 1 | ... |"), or None when it cannot be imported (missing, or its shared library fails to load).
    A portable wheel is built for one level (the shared wheel: AVX2), a native build for its CPU (AVX-512 where the
    CPU has it), whatever CPU runs it."""
    try:
        import llama_cpp
    except Exception:         # not installed, or its library fails to load (llama_cpp raises RuntimeError then)
        return None
    info = llama_cpp.llama_print_system_info().decode()
    cpu = info.split("CPU :", 1)[1] if "CPU :" in info else info
    return [m.group(1) for m in re.finditer(r"(\w+) = 1\b", cpu.split(";")[0])]


def simd_of(features) -> str:
    """A build's CPU features -> "avx512" when it uses AVX-512, else "avx2"."""
    return "avx512" if any(f.startswith("AVX512") for f in features) else "avx2"


def installed_simd() -> str | None:
    """The installed llama-cpp-python build's width ("avx2" or "avx512"), or None when it is not installed."""
    features = installed_build_features()
    return None if features is None else simd_of(features)
