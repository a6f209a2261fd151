"""Backends: an array module `xp` plus conversions. NumPy is the oracle."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable

from ..errors import ParameterError

BACKENDS = ("numpy",)


@dataclass(frozen=True)
class Backend:
    name: str
    xp: Any
    asarray: Callable
    to_numpy: Callable
    device: str


def get_backend(name=None) -> Backend:
    name = name or os.environ.get("LLORCH_BACKEND") or "numpy"
    if name == "numpy":
        import numpy as np

        return Backend("numpy", np, lambda a: a, lambda a: a, "cpu")
    raise ParameterError(f"backend {name!r} is not available (available: {', '.join(BACKENDS)})")
