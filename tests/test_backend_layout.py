"""Where the backends' code lives: the reference forward (model/forward.py) is the plain sequence of layer
functions, with no probe of the backend it runs on (fused paths live in the backends' own forward)."""
from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_reference_forward_asks_nothing_of_the_backend():
    """No hasattr/getattr on ops, no watched-or-not switch, no residual handed between blocks."""
    src = (ROOT / "llorch_ref" / "model" / "forward.py").read_text()
    for probe in ("hasattr(ops", "getattr(ops", "observes_tensors", "residual=", "fusions", "static_decode"):
        assert probe not in src, f"model/forward.py holds {probe!r}"


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

