"""`llorch-ref bench` on a file without a vocabulary (token ids for every engine, llama.cpp included), with the
CPU named and each matrix product's path counted; the vector registers of a compiled kernel read from its code."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


def test_bench_runs_every_engine_on_a_file_without_a_vocabulary(tiny, tmp_path, llamacpp):
    pytest.importorskip("numba")
    model = tiny(vocab="none", weight_type="Q4_0")
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, "-m", "llorch_ref.cli", "bench", "--model", str(model), "--engines",
                        "numpy,numba,llamacpp", "--prefill", "8", "--decode", "4", "--repeats", "1", "--threads", "1",
                        "--json", str(out)], capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, LLORCH_BENCH_VECTOR_REGISTERS="0"))
    assert r.returncode == 0, r.stdout + r.stderr
    rep = json.loads(out.read_text())
    assert [x.get("error") for x in rep["results"]] == [None] * 3
    assert rep["cpu_model"] and "CPU " + rep["cpu_model"] in r.stdout
    paths = next(x for x in rep["results"] if x["engine"].startswith("llorch-ref numba"))["info"]["matrix_paths"]
    assert any("Q4_0: numba kernel" in k and k.endswith("1 row") for k in paths), paths
    assert "matrix products by path" in r.stdout
    for x in rep["results"]:                       # every timed run kept, the median among them
        assert len(x["prefill_runs"]) == 1 and x["prefill_tok_s"] == pytest.approx(x["prefill_runs"][0], abs=1e-3)
    assert "run-to-run spread" in r.stdout


def test_vector_registers_are_read_from_the_compiled_code():
    pytest.importorskip("numba")
    from llorch_ref.backends.numba_backend import vector_registers

    got = vector_registers(["matmul_rows"])["matmul_rows"]
    assert got.split()[0] in ("zmm", "ymm", "xmm") and "operands" in got
