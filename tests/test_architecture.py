"""The import graph of llorch_ref/ keeps the layers of docs/architecture.md: every import (at the top of a
module or inside a function) goes to a lower layer or stays inside its own unit, every module is placed,
and no modules import each other in a circle."""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "llorch_ref"


def layers() -> dict:
    text = (ROOT / "docs" / "architecture.md").read_text()
    out = {}
    for n, units in re.findall(r"^\| (\d+) \| ([^|]+) \|$", text, flags=re.M):
        for u in units.split(","):
            out[u.strip().replace("\\_", "_")] = int(n)
    return out


def module_of(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, root: Path = ROOT) -> set:
    mod = module_of(path, root)
    pkg = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.startswith("llorch_ref"):
                names = [a.name for a in node.names]
                subs = [f"{target}.{n}" for n in names if (root / f"{target}.{n}".replace(".", "/")).exists()
                        or (root / (f"{target}.{n}".replace(".", "/") + ".py")).exists()]
                found |= set(subs) or {target}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("llorch_ref")}
    return found


def unit(mod: str) -> str:
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def graph() -> dict:
    return {module_of(p): imports(p) for p in PKG.rglob("*.py")}


def test_every_unit_is_placed_in_a_layer():
    placed = layers()
    units = {unit(m) for m in graph()}
    assert units - set(placed) == set(), f"modules not in docs/architecture.md: {sorted(units - set(placed))}"
    assert set(placed) - units == set(), f"docs/architecture.md places units that do not exist: {sorted(set(placed) - units)}"


def upward(g: dict, placed: dict) -> list:
    bad = []
    for mod, targets in sorted(g.items()):
        for t in sorted(targets):
            a, b = unit(mod), unit(t)
            if a != b and placed[b] >= placed[a]:
                bad.append(f"{mod} (layer {placed[a]}) imports {t} (layer {placed[b]})")
    return bad


def test_imports_only_go_down():
    bad = upward(graph(), layers())
    assert not bad, "imports that do not go down:\n" + "\n".join(bad)


def cycles(g: dict) -> list:
    """Module-level import cycles (a package's __init__ handing on names of its own modules is left out)."""
    known = set(g)
    edges = {m: {t if t in known else t.rsplit(".", 1)[0] for t in ts} & known - {m} for m, ts in g.items()}
    edges = {m: {t for t in ts if not t.startswith(m + ".")} for m, ts in edges.items()}
    found, state = [], {}

    def visit(m, path):
        state[m] = "open"
        for t in sorted(edges[m]):
            if state.get(t) == "open":
                found.append(path[path.index(t):] + [t])
            elif t not in state:
                visit(t, path + [t])
        state[m] = "done"
    for m in sorted(edges):
        if m not in state:
            visit(m, [m])
    return found


def test_no_import_cycles():
    found = cycles(graph())
    assert not found, "import cycles: " + "; ".join(" -> ".join(c) for c in found)


def test_the_check_can_fail(tmp_path):
    """Planted: the model importing the harness (up), and dump importing convert (sideways in its layer)."""
    fake = tmp_path / "llorch_ref" / "model"
    fake.mkdir(parents=True)
    (fake / "layers.py").write_text("from ..harness.compare import compare_dumps\n")
    (tmp_path / "llorch_ref" / "dump.py").write_text("def f():\n    from .convert import convert_gguf\n")
    g = {module_of(p, tmp_path): imports(p, tmp_path) for p in (tmp_path / "llorch_ref").rglob("*.py")}
    bad = upward(g, layers())
    assert any("llorch_ref.model.layers (layer 2) imports llorch_ref.harness.compare" in b for b in bad), bad
    assert any("llorch_ref.dump (layer 5) imports llorch_ref.convert" in b for b in bad), bad
    (tmp_path / "llorch_ref" / "convert.py").write_text("from .dump import Dump\n")
    g = {module_of(p, tmp_path): imports(p, tmp_path) for p in (tmp_path / "llorch_ref").rglob("*.py")}
    assert ["llorch_ref.convert", "llorch_ref.dump", "llorch_ref.convert"] in cycles(g)


# llorch-ref modules imported inside functions on purpose: (importing file, imported module) -> why
LAZY_ON_PURPOSE = {
    ("llorch_ref/backends/__init__.py", "llorch_ref.backends.numba_backend"): "numba, an optional dependency",
    ("llorch_ref/backends/__init__.py", "llorch_ref.backends.cupy_backend"): "cupy, an optional dependency",
    ("llorch_ref/cli/commands.py", "llorch_ref.server.app"): "the web stack, for serve only",
    ("llorch_ref/bench.py", "llorch_ref.backends.numba_backend"): "numba, an optional dependency",
    ("llorch_ref/cli/commands.py", "llorch_ref.server.connections"): "the web stack, for serve only",
}
PLUGIN = "llorch_ref/pytest_plugin.py"      # loaded by every pytest session: imports the harness when asked


def test_internal_imports_sit_at_the_top():
    bad = []
    for p in sorted(PKG.rglob("*.py")):
        rel = str(p.relative_to(ROOT))
        tree = ast.parse(p.read_text())
        top = {id(n) for n in tree.body}
        for node in ast.walk(tree):
            if id(node) in top or not isinstance(node, ast.ImportFrom) or rel == PLUGIN:
                continue
            if node.level or (node.module or "").startswith("llorch_ref"):
                targets = imports_of_node(node, p)
                if not all((rel, t) in LAZY_ON_PURPOSE for t in targets):
                    bad.append(f"{rel}:{node.lineno} imports {', '.join(sorted(targets))} inside a function")
    assert not bad, "\n".join(bad)


def imports_of_node(node, path: Path) -> set:
    mod = module_of(path)
    pkg = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
    if node.level:
        base = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
        return {".".join(base + ([node.module] if node.module else []))}
    return {node.module}
