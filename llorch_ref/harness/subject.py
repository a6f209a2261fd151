"""A MODULE:CALLABLE subject, as sweep --subject and the pytest plugin's --llorch-subject take it: the callable
found by its import path, and what it returns (a Recorder, a Dump or a dump file's path) read as a Dump. The
option a face names (`option`) is the one its error messages name."""
from __future__ import annotations

import importlib

from ..dump import Dump, Recorder, load_dump
from ..errors import ParameterError


def load_callable(spec: str, option: str = "--subject"):
    """'MODULE:FUNCTION' (FUNCTION may be dotted) -> the callable; ParameterError where it is not one."""
    if ":" not in spec:
        raise ParameterError(f"{option} {spec!r}: expected MODULE:CALLABLE")
    mod, _, attr = spec.partition(":")
    try:
        obj = importlib.import_module(mod)
    except ImportError as e:
        raise ParameterError(f"{option} {spec!r}: cannot import {mod} ({e})") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ParameterError(f"{option} {spec!r}: {mod} has no {attr}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ParameterError(f"{option} {spec!r}: {attr} is not callable")
    return obj


def as_dump(out, spec: str, option: str = "--subject", prompt: str | None = None) -> Dump:
    """What a subject returns -> a Dump; a Recorder that names no prompt is given `prompt`."""
    if isinstance(out, Recorder):
        if out.prompt is None and prompt is not None:
            out.prompt = prompt
        return out.to_dump()
    if isinstance(out, Dump):
        return out
    if isinstance(out, (str, bytes)) or hasattr(out, "__fspath__"):
        return load_dump(out)
    raise TypeError(f"{option} {spec} returned {type(out).__name__}; expected a Recorder, Dump or path")
