"""A normal (non-editable) install finds its checkpoint catalogue: the project is built into a wheel, installed
into a fresh virtual environment (dependencies borrowed from this one through a .pth file, so nothing is
downloaded), and `llorch-ref prove`, `diff` and the pytest plugin run from a folder outside the checkout."""
from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    d = tmp_path_factory.mktemp("install")
    src, wheels = d / "src", d / "wheels"        # built from a copy: the build leaves nothing in the checkout
    shutil.copytree(ROOT / "llorch_ref", src / "llorch_ref", ignore=shutil.ignore_patterns("__pycache__"))
    for f in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / f, src / f)
    b = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                        str(wheels), str(src)], capture_output=True, text=True, timeout=300)
    if b.returncode != 0:
        pytest.fail(f"building the wheel failed: {b.stderr[-2000:]}")
    venv = d / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    (site / "borrowed.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")   # this venv's dependencies
    whl = next(wheels.glob("llorch_ref-*.whl"))
    i = subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "-q", str(whl)],
                       capture_output=True, text=True, timeout=300)
    if i.returncode != 0:
        pytest.fail(f"installing the wheel failed: {i.stderr[-2000:]}")
    work = d / "elsewhere"
    work.mkdir()
    return py, work


def run(installed, *args, timeout=600):
    py, work = installed
    return subprocess.run([str(py), *args], cwd=work, capture_output=True, text=True, timeout=timeout)


def test_the_installed_package_is_not_the_checkout(installed):
    r = run(installed, "-c", "import llorch_ref, llorch_ref.checkpoints as c; print(llorch_ref.__file__); "
                             "print(len(c.load_specs()))")
    assert r.returncode == 0, r.stderr
    where, n = r.stdout.split()
    assert str(ROOT) not in where and "site-packages" in where
    assert int(n) == len(list((ROOT / "llorch_ref" / "checkpoints").glob("cp*.json")))


@pytest.mark.llamacpp
@pytest.mark.default_model
def test_prove_and_diff_run_from_a_normal_install(installed, llamacpp, default_model):
    r = run(installed, "-m", "llorch_ref.cli", "prove", "--checkpoint", "1", "--greedy", "0", "--out", "bundles")
    assert r.returncode == 0, r.stdout + r.stderr
    assert list((installed[1] / "bundles").glob("*/cp1_rms_norm/report.md"))
    assert list((installed[1] / "bundles").glob("*/report.html"))     # the template ships in the package
    r = run(installed, "-m", "llorch_ref.cli", "diff", "--checkpoint", "2", "--greedy", "0")
    assert r.returncode == 0 and "first divergence: none" in r.stdout, r.stdout + r.stderr


def test_the_pytest_plugin_checks_a_dump_from_a_normal_install(installed, tiny):
    """A dump of llorch-ref itself on a tiny model, checked by the installed plugin: every case passes."""
    model = tiny(n_layers=2, vocab="bpe")
    r = run(installed, "-c", "import sys, llorch_ref\n"
            "from llorch_ref.references.llorch import record_engine\n"
            "e = llorch_ref.load(sys.argv[1])\n"
            "record_engine(e, e.tokenizer.encode('Once upon a time'), prompt='Once upon a time', n_greedy=4).save('d.safetensors')", str(model))
    assert r.returncode == 0, r.stderr
    r = run(installed, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--llorch-dump", "d.safetensors",
            "--llorch-model", str(model))
    assert r.returncode == 0 and " passed" in r.stdout and "failed" not in r.stdout, r.stdout + r.stderr
