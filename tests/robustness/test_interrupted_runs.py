"""Runs killed at any point (kill -9) leave no bundle that looks complete; reruns work; captures are
byte-identical across runs."""
from __future__ import annotations

import hashlib
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest


def prove_cmd(model, out, run_id, *more):
    """(--no-plots: matplotlib's import and drawing took three quarters of each run; the files are written and
    staged the same way, images aside: test_bundle.py::test_prove_without_plots_writes_the_same_files_less_the_images)"""
    return [sys.executable, "-m", "llorch_ref.cli", "prove", "--model", str(model), "--out", str(out),
            "--run-id", run_id, "--greedy", "4", "--no-plots", *more]


SOME = ["--checkpoint", "1", "--checkpoint", "4", "--checkpoint", "8", "--checkpoint", "12"]   # several folders


def looks_complete(out: Path, run_id: str) -> list:
    """A run folder that exists but is not whole (a file missing from its manifest, or no manifest): must be
    empty. A killed run leaves at most its hidden staging folder."""
    from llorch_ref.harness.verify import check_files, read_manifest

    run = out / run_id
    if not run.exists():
        return []
    try:
        return [] if check_files(run, read_manifest(run)).files_ok else [run]
    except Exception:
        return [run]


@pytest.mark.parametrize("runs, kills", [(6, 4), pytest.param(12, 6, marks=pytest.mark.slow)])
def test_kill_9_at_random_points_leaves_nothing_that_looks_complete(tiny, tmp_path, llamacpp, runs, kills):
    """Kill times drawn one in each of `runs` equal slices of 0.2 s .. 1.1 x a whole run (so they reach every phase
    of it, the bundle's writing included), more runs (from the slices again) while fewer than `kills` were killed;
    after each, the same run id works again (a complete one is refused, an interrupted one redone). The default
    run: 6 slices; `-m slow`: 12."""
    model = tiny(vocab="bpe")
    out = tmp_path / "pb"
    t0 = time.perf_counter()
    subprocess.run(prove_cmd(model, out, "timing", *SOME), check=True, capture_output=True, timeout=300)
    full = time.perf_counter() - t0
    rng = np.random.default_rng(0)
    lo, hi = 0.2, full * 1.1
    killed, complete_looking, completed = 0, 0, 0
    for i in range(2 * runs):       # a host slowed by other work during the timing run lets more runs finish early
        if i >= runs and killed >= kills:
            break
        run_id = f"k{i}"
        p = subprocess.Popen(prove_cmd(model, out, run_id, *SOME), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(lo + (i % runs + float(rng.uniform())) * (hi - lo) / runs)
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)
            killed += 1
        p.wait()
        complete_looking += len(looks_complete(out, run_id))
        existed = (out / run_id).exists()
        completed += existed
        r = subprocess.run(prove_cmd(model, out, run_id, *SOME), capture_output=True, text=True, timeout=300)
        if existed:
            assert r.returncode == 2
            assert "never overwritten" in r.stderr
        else:
            assert r.returncode in (0, 1), r.stderr
            assert (out / run_id / "manifest.json").exists()
    print(f"{killed} runs killed with SIGKILL, {completed} finished first, {complete_looking} bundles left "
          f"looking complete")
    assert killed >= kills and complete_looking == 0


@pytest.mark.parametrize("runs", [4, pytest.param(20, marks=pytest.mark.slow)])
def test_captures_are_byte_identical_across_runs(tiny, tmp_path, llamacpp, runs):
    model = tiny(vocab="bpe")
    digests = set()
    for i in range(runs):
        out = tmp_path / f"r{i}"
        subprocess.run(prove_cmd(model, out, "same") + ["--checkpoint", "4", "--checkpoint", "8"], check=True,
                       capture_output=True, timeout=300)
        h = hashlib.sha256()
        for f in sorted(out.glob("same/cp*/*.npz")):
            with np.load(f) as z:
                for k in sorted(z.files):
                    h.update(k.encode())
                    h.update(z[k].tobytes())
        digests.add(h.hexdigest())
    assert len(digests) == 1
