"""tools/kernel_ab.py's base package: the base's kernel files from a folder, a constant rewritten by --base-set, and
one-line refusals of a base or a setting it cannot apply (nothing compiled here)."""
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
KERNELS = ROOT / "llorch_ref" / "backends"


def _tool():
    spec = importlib.util.spec_from_file_location("kernel_ab", ROOT / "tools" / "kernel_ab.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_folder_base_with_a_constant_rewritten(tmp_path):
    kab = _tool()
    name = kab.base_package(str(KERNELS), tmp_path, ["PANEL_TOKENS=(16, 16)", " SUPER_ROWS = {'Q2_K': 1} "])
    pkg = tmp_path / name
    for f in kab.KERNEL_FILES:
        assert (pkg / f).is_file(), f
    simd = (pkg / "numba_simd.py").read_text().splitlines()
    here = (KERNELS / "numba_simd.py").read_text().splitlines()
    changed = [(a, b) for a, b in zip(here, simd) if a != b]
    assert len(simd) == len(here)
    assert [b for _, b in changed] == ["PANEL_TOKENS = (16, 16)", "SUPER_ROWS = {'Q2_K': 1}"]
    assert all(a.startswith(("PANEL_TOKENS = ", "SUPER_ROWS = ")) for a, _ in changed)
    assert (pkg / "numba_kernels.py").read_text() == (KERNELS / "numba_kernels.py").read_text()


@pytest.mark.parametrize("base, sets, says", [
    ("{tmp}/nothing-here", [], "neither a commit of this repository nor a folder holding numba_simd.py"),
    ("{kernels}", ["PANEL_TOKENS"], "give NAME=VALUE"),
    ("{kernels}", ["NO_SUCH_CONSTANT=1"], "needs exactly one line 'NO_SUCH_CONSTANT = ...' (it has 0)"),
])
def test_a_base_or_setting_it_cannot_apply_is_refused_in_one_line(tmp_path, base, sets, says):
    kab = _tool()
    with pytest.raises(SystemExit) as e:
        kab.base_package(base.format(tmp=tmp_path, kernels=KERNELS), tmp_path, sets)
    msg = str(e.value)
    assert says in msg and "\n" not in msg
