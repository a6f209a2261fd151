"""Where the backends' code lives: the reference forward (model/forward.py) is the plain sequence of layer
functions, with no probe of the backend it runs on (fused paths live in the backends' own forward); the CUDA C is
in .cu files shipped as package data, not in long Python strings."""
from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BACKENDS = ROOT / "llorch_ref" / "backends"
CUDA_MARKS = re.compile(r"__global__|__device__|#include\s*<")
MAX_CUDA_LINES = 40


def test_reference_forward_asks_nothing_of_the_backend():
    """No hasattr/getattr on ops, no watched-or-not switch, no residual handed between blocks."""
    src = (ROOT / "llorch_ref" / "model" / "forward.py").read_text()
    for probe in ("hasattr(ops", "getattr(ops", "observes_tensors", "residual=", "fusions", "static_decode"):
        assert probe not in src, f"model/forward.py holds {probe!r}"


def cuda_strings(path: Path):
    """(line, lines) of every string constant in path that reads as CUDA C."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and CUDA_MARKS.search(node.value):
            yield node.lineno, node.value.count("\n") + 1


def test_no_long_cuda_source_in_python():
    long = [f"{p.relative_to(ROOT)}:{line} ({n} lines)" for p in sorted(BACKENDS.rglob("*.py"))
            for line, n in cuda_strings(p) if n > MAX_CUDA_LINES]
    assert not long, "CUDA C belongs in llorch_ref/backends/cuda/*.cu: " + ", ".join(long)


def test_cuda_files_exist_and_are_package_data():
    from llorch_ref.backends.cuda_source import FILES, cuda_source

    on_disk = {p.name for p in (BACKENDS / "cuda").glob("*.cu")}
    assert on_disk == set(FILES)
    assert all("__global__" in cuda_source(n) or "__device__" in cuda_source(n) for n in FILES)
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert "cuda/*.cu" in data.get("llorch_ref.backends", [])


def test_a_recorder_that_watches_gets_the_reference_forward(tiny, monkeypatch):
    """Engine.forward: a recorder that looks at tensors runs model.forward; none, or one of the layer boundaries
    only, runs the backend's own forward."""
    import llorch_ref
    from llorch_ref.model import forward as forward_mod

    eng = llorch_ref.load(tiny(vocab="none"))
    ran = []
    monkeypatch.setattr(eng.backend, "forward", lambda *a, **k: ran.append("backend") or "b")
    ref = forward_mod.forward
    monkeypatch.setattr(forward_mod, "forward", lambda *a, **k: ran.append("reference") or ref(*a, **k))

    def boundary(name, layer, arr):
        pass
    boundary.tensors = False
    eng.forward([1, 2], eng.new_cache())
    eng.forward([1, 2], eng.new_cache(), record=boundary)
    eng.forward([1, 2], eng.new_cache(), record=lambda name, layer, arr: None)
    assert ran == ["backend", "backend", "reference"]


def test_backend_switches_are_read_through_settings_only():
    """No backend module reads an LLORCH_CUDA_, LLORCH_NUMBA_ or LLORCH_BLAS_ variable itself, and settings.py's
    docstring says what each of its switches does."""
    from llorch_ref.backends import settings as S

    switch = re.compile(r"environ\.get\(\s*[\"']LLORCH_(CUDA|NUMBA|BLAS)_")
    readers = [p.name for p in sorted(BACKENDS.glob("*.py")) if p.name != "settings.py" and switch.search(p.read_text())]
    assert not readers, f"switches read outside backends/settings.py: {readers}"
    doc = S.__doc__
    for f in S.fields(S.Settings):
        assert S.env_name(f.name) in doc, f"{S.env_name(f.name)} is not described in backends/settings.py"
    assert S.settings({"LLORCH_CUDA_PDL": "0"}) == S.Settings(cuda_pdl=False)
