"""eval on Ray with a cupy side: an actor a GPU (num_gpus=1, no more actors than GPUs); a cluster without a GPU
is refused with RayEvalError before any actor starts."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from llorch_ref.harness.ray_eval import on_gpu
from llorch_ref.references.logit_sources import SourceSpec

PROBE = """
import ray
from llorch_ref.harness.ray_eval import RayEvalError, run_eval_ray
from llorch_ref.references.logit_sources import SourceSpec
ray.init(num_cpus=2, num_gpus=0, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
try:
    run_eval_ray(SourceSpec("numpy", "no-such.gguf"), SourceSpec("cupy", "no-such.gguf"), [[1] * 16] * 3, "t")
except RayEvalError as e:
    print("refused:", e)
"""


def test_a_cupy_side_marks_the_actors_for_gpus():
    assert on_gpu(SourceSpec("numpy", "m"), SourceSpec("cupy", "m"))
    assert not on_gpu(SourceSpec("numpy", "m"), SourceSpec("llamacpp", "m"))


def test_a_cupy_side_on_a_cluster_without_a_gpu_is_refused():
    pytest.importorskip("ray", reason="Ray is not installed (pip install 'llorch-ref[ray]')")
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    r = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=180, env=env)
    assert r.stdout.strip() == "refused: a cupy side on Ray needs a GPU in the cluster, and Ray sees none", \
        r.stdout[-1000:] + r.stderr[-2000:]


def test_the_memory_check_counts_processes_and_weights_where_they_are(monkeypatch):
    """eval's memory check counts the processes a local Ray starts (one a GPU with a cupy side, one a core
    otherwise) and the weights each side holds in this host's memory (a cupy side's: while it loads)."""
    import types

    from llorch_ref.cli import evaluate
    seen, sides = [], []
    monkeypatch.setattr(evaluate, "check_memory", lambda *a: seen.append(a[5]) or sides.append(a[4]) or 0)
    monkeypatch.setattr(evaluate, "gpu_count", lambda: 3)
    monkeypatch.setattr(evaluate.os, "cpu_count", lambda: 16)
    eng = types.SimpleNamespace(weights_info=lambda: {"dequantized_mb": 1}, config=None)
    for ref, subject, ray in (("cupy", "numpy", ""), ("numpy", "cupy", ""), ("numpy", "numpy", ""),
                              ("cupy", "cupy", None)):
        args = types.SimpleNamespace(ray=ray, reference_backend=ref, ctx=64)
        evaluate._memory_check(args, eng, SourceSpec(subject, "m"))(40, 0)
    assert seen == [3, 3, 16, 1]
    assert sides == [2, 2, 2, 1]          # a cupy side's weights in host memory only while it loads
    args = types.SimpleNamespace(ray=None, reference_backend="cupy", ctx=64)
    evaluate._memory_check(args, eng, SourceSpec("dump", "d"))(40, 0)
    assert sides[-1] == 1
