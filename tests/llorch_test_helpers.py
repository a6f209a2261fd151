"""Helpers shared by the tests (a module, not conftest.py, so that tests can import it by name)."""
from __future__ import annotations

from pathlib import Path

import pytest


def machine_config() -> dict:
    """.llorch-test.toml at the repository root (ignored by git; see .llorch-test.toml.example)."""
    import tomllib

    p = Path(__file__).resolve().parents[1] / ".llorch-test.toml"
    return tomllib.loads(p.read_text()) if p.exists() else {}


def need_backend(name):
    """Skip with the reason where a backend is unavailable, or fail if this machine's config requires it."""
    from llorch_ref.backends import available

    reason = available().get(name)
    if reason:
        if name in machine_config().get("require_backends", []):
            pytest.fail(f"backend {name} is required by .llorch-test.toml but unavailable: {reason}")
        pytest.skip(f"backend {name} unavailable: {reason}")


def tiny_hf_gguf(folder: Path, arch: str) -> tuple:
    """A tiny random transformers model of `arch` (testing.tiny_hf) under folder, and its GGUF made by llorch-ref's
    converter -> (the Hugging Face folder, the GGUF path, the transformers model); skips where torch or
    transformers is missing."""
    pytest.importorskip("torch", reason="torch is not installed (pip install -e '.[hf]')")
    pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[hf]')")
    from llorch_ref.convert import convert_hf_to_gguf
    from llorch_ref.testing.tiny_hf import write_tiny_hf

    hf, model = write_tiny_hf(folder / arch, arch)
    return hf, convert_hf_to_gguf(hf, folder / f"{arch}.gguf"), model


def where(fd):
    """A first divergence (verdict JSON) -> (step, checkpoint, layer, tensor); None for none."""
    return None if fd is None else (fd["step"], fd["checkpoint"], fd["layer"], fd["tensor"])
