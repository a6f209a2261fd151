"""One vocabulary for float types: float32, float16, bfloat16 (the K/V cache, weight storage, convert).
llama.cpp's short names (f32, f16, bf16), which dumps and commands of earlier versions used, are read as
the same types; everything this project writes uses the long ones."""
from __future__ import annotations

from .errors import ParameterError

FLOAT_TYPES = ("float32", "float16", "bfloat16")
KV_DTYPES = ("float32", "float16")                 # the K/V cache types
SHORT = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}    # llama.cpp's names (its settings, GGUF types)
_FROM_SHORT = {v: k for k, v in SHORT.items()}


def dtype_name(x, allowed=FLOAT_TYPES, what: str = "dtype") -> str:
    """-> the long name of a float type (f32 -> float32); ParameterError, naming the choices, otherwise."""
    name = _FROM_SHORT.get(x, x)
    if name not in allowed:
        raise ParameterError(f"{what} {x!r} must be one of {', '.join(allowed)}")
    return name
