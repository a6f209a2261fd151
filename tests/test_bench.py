"""`llorch-ref bench` on a file without a vocabulary (token ids for every engine, llama.cpp included), with the
CPU named, each matrix product's path counted and the host's speed probed around each engine; the vector
registers of a compiled kernel read from its code."""
from __future__ import annotations

import json
import os
import platform
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
    assert "llorch-ref numba lazy: BLAS " in r.stdout or "llorch-ref numba eager: BLAS " in r.stdout
    llama = next(x for x in rep["results"] if x["engine"] == "llama.cpp")["info"]["settings"]["build"]
    assert f"llama.cpp: its build's CPU features {' '.join(llama)}" in r.stdout
    for x in rep["results"]:                       # every timed run kept, the median among them
        assert len(x["prefill_runs"]) == 1 and x["prefill_tok_s"] == pytest.approx(x["prefill_runs"][0], abs=1e-3)
    assert "run-to-run spread" in r.stdout
    probes = rep["host_probe_gflops"]              # before each engine and after the last
    assert len(probes) == 4 and all(p > 0 for p in probes)
    assert "host speed (float32 products in cache" in r.stdout
    assert rep["model_mb"] == os.path.getsize(model) / 1e6
    numba = next(x for x in rep["results"] if x["engine"].startswith("llorch-ref numba"))
    assert f"| {numba['peak_mb']:.0f} | {numba['peak_mb'] / rep['model_mb']:.2f}x |" in r.stdout
    for x in rep["results"]:                       # every engine's first runs timed: what its load left to them
        assert set(x["first_runs_tok_s"]) == {"prefill", "decode"} and isinstance(x["after_load_s"], float)
        assert f"| {x['load_s']:.2f} ({x['after_load_s']:+.2f}) |" in r.stdout
    assert numba["info"]["kernels_compiled_after_load"] >= 0


def test_bench_names_the_blas_kernels_and_who_chose_them():
    """The prefill's products run on numpy's BLAS, whose kernel set can be forced by OPENBLAS_CORETYPE (a machine of
    this workplace sets Haswell on an AVX-512 CPU, 0.7x OpenBLAS's own choice there): the report names the set
    OpenBLAS loaded and says when the environment chose it; each side is checked in a fresh process."""
    code = "import llorch_ref.backends as b, numpy as np; np.ones((2, 2)) @ np.ones((2, 2)); print(b.blas_info())"
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_CORETYPE"}
    own = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env).stdout.strip()
    if not own.startswith("openblas") or platform.machine() != "x86_64":
        pytest.skip(f"numpy's BLAS here is not OpenBLAS on x86-64: {own}")
    assert " kernels, " in own and "OPENBLAS_CORETYPE" not in own, own
    forced = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env=dict(env, OPENBLAS_CORETYPE="Sandybridge")).stdout.strip()
    assert "Sandybridge kernels (chosen by OPENBLAS_CORETYPE=Sandybridge in the environment)" in forced, forced


def test_bench_peak_memory_is_in_megabytes():
    """peak_mb is 10^6 bytes, as the table's "peak MB" says (not MiB, 4.9% less): the kernel's own high-water
    mark, /proc/self/status VmHWM in KiB, converted independently."""
    from llorch_ref.bench import _peak_mb

    hwm = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
    assert _peak_mb() == pytest.approx(hwm * 1024 / 1e6, rel=0.01)


def test_bench_warns_when_the_host_speed_moved_during_the_run():
    """The probe's figures printed beside the engines they preceded; a move of more than a fifth warned of."""
    from llorch_ref.bench import _probe_lines

    steady = "\n".join(_probe_lines([100.0, 95.0, 104.0], ["numba", "llama.cpp"]))
    assert "before numba 100.0, before llama.cpp 95.0, after the last 104.0" in steady
    assert "warning" not in steady
    moved = "\n".join(_probe_lines([100.0, 52.0, 98.0], ["numba", "llama.cpp"]))
    assert "warning: the host's speed moved by 1.92x" in moved
    assert _probe_lines(None, ["numba"]) == []          # reports written before the probe existed


def test_vector_registers_are_read_from_the_compiled_code():
    pytest.importorskip("numba")
    from llorch_ref.backends.numba_backend import vector_registers

    got = vector_registers(["matmul_rows"])["matmul_rows"]
    assert got.split()[0] in ("zmm", "ymm", "xmm") and "operands" in got


def test_bench_interleaved_pairs_each_round_and_reports_an_engine_that_fails(tiny, tmp_path, llamacpp):
    """--interleave: the engines loaded one after another (and each again in two fresh processes), timed in rounds; each ratio is the median of the rounds' ratios to
    llama.cpp (each round's runs back to back); an engine that cannot load is reported and the others still run."""
    pytest.importorskip("numba")
    import importlib.util

    model = tiny(vocab="none", weight_type="Q4_0")
    out = tmp_path / "bench.json"
    engines = ["numba", "llamacpp"] + ([] if importlib.util.find_spec("cupy") else ["cupy"])
    r = subprocess.run([sys.executable, "-m", "llorch_ref.cli", "bench", "--model", str(model), "--engines",
                        ",".join(engines), "--prefill", "8", "--decode", "4", "--repeats", "3", "--threads", "1",
                        "--interleave", "--json", str(out)], capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, LLORCH_BENCH_VECTOR_REGISTERS="0"))
    rep = json.loads(out.read_text())
    assert rep["interleaved"] is True and len(rep["host_probe_gflops"]) == 3
    numba, llama = rep["results"][:2]
    assert "error" not in numba and "error" not in llama, r.stderr
    for kind in ("prefill", "decode"):
        assert len(numba[f"{kind}_runs"]) == len(llama[f"{kind}_runs"]) == 3
        want = [a / b for a, b in zip(numba[f"{kind}_runs"], llama[f"{kind}_runs"])]
        # each stored ratio is its round's, rounded to 3 decimals (rel=2e-3 failed a new user's run at 0.146)
        assert numba[f"{kind}_vs_llamacpp_runs"] == pytest.approx(want, abs=5e-4 + 1e-9)
    import statistics
    row = next(ln for ln in r.stdout.splitlines() if ln.startswith("| llorch-ref numba"))
    assert row.rstrip(" |").endswith(f"{statistics.median(numba['decode_vs_llamacpp_runs']):.2f}x")
    assert "interleaved: the engines loaded one after another" in r.stdout
    assert len(numba["load_runs"]) == len(llama["load_runs"]) == 3 and numba["load_s"] in numba["load_runs"]
    if "cupy" in engines:                          # no cupy here: its process fails to load, reported in one line
        assert rep["results"][2]["error"] and r.returncode == 1
        assert "| cupy | - |" in r.stdout
    else:
        assert r.returncode == 0, r.stderr


COMPILE_PROBE = """
import numpy as np
from llorch_ref.backends import numba_backend as B
B.K.silu_mul(np.ones(4, np.float32), np.ones(4, np.float32), np.empty(4, np.float32))
print(B.kernels_compiled())
"""


def test_a_load_that_compiled_kernels_is_counted_and_warned_of(tmp_path):
    """kernels_compiled counts what numba compiled in the process, not what it loaded from its cache: with a fresh
    cache folder the kernel is compiled (1), in the next process it is loaded (0). The bench's table then warns that
    such a load is mostly compile (a 12.2 s load would otherwise be printed without a word)."""
    pytest.importorskip("numba")
    from llorch_ref.bench import markdown

    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path))

    def compiled():
        return subprocess.run([sys.executable, "-c", COMPILE_PROBE], env=env, check=True, capture_output=True,
                              text=True, timeout=300).stdout.split()
    assert compiled() == ["1"] and compiled() == ["0"]
    row = {"engine": "llorch-ref numba lazy", "device": "cpu", "load_s": 12.2, "prefill_tok_s": 1.0,
           "decode_tok_s": 1.0, "peak_mb": 1.0, "info": {"kernels_compiled": 7, "compile_or_cache_load_s": 11.3}}
    report = {"model": "m.gguf", "threads": 2, "prefill_tokens": 8, "decode_tokens": 8, "repeats": 1, "results": [row]}
    assert "warning: llorch-ref numba lazy compiled 7 kernel signatures while loading" in markdown(report)
    row["info"]["kernels_compiled"] = 0
    assert "compiled" not in markdown(report)
    row["info"]["kernels_compiled_after_load"], row["after_load_s"] = 3, 9.5
    assert "warning: llorch-ref numba lazy compiled 3 kernel signatures on first use" in markdown(report)
    assert "the 9.5 s left to its first runs are mostly compile" in markdown(report)


def test_after_load_is_the_first_runs_time_beyond_warm_ones():
    """A load that leaves work to the first request (kernels loaded on first use, weights first touched) shows it:
    the first prefill's and first decode's seconds over their warm medians', in the table beside the load."""
    from llorch_ref.bench import after_load_s, markdown

    row = {"engine": "e", "device": "cpu", "load_s": 0.25, "prefill_tok_s": 8.0, "decode_tok_s": 4.0, "peak_mb": 1.0,
           "first_runs_tok_s": {"prefill": 4.0, "decode": 2.0}}
    tokens = {"prefill": 8, "decode": 4}
    assert after_load_s(row, tokens) == pytest.approx((8 / 4 - 8 / 8) + (4 / 2 - 4 / 4))
    row["after_load_s"] = after_load_s(row, tokens)
    report = {"model": "m.gguf", "threads": 2, "prefill_tokens": 8, "decode_tokens": 4, "repeats": 1, "results": [row]}
    assert "| e | cpu | 0.25 (+2.00) |" in markdown(report)
    row["first_runs_tok_s"] = {"prefill": 16.0, "decode": 4.0}          # a first run faster than the median: negative
    assert after_load_s(row, tokens) == pytest.approx(8 / 16 - 8 / 8)
    assert after_load_s({**row, "first_runs_tok_s": {"prefill": 4.0}}, tokens) is None     # a first run missing


def test_bench_weight_cache_reaches_numba_and_puts_its_prompts_on_blas(tiny, tmp_path):
    """bench --weight-cache-mb on the numba engine: the budget is the user's and its prompts run by BLAS on the
    float32 layers kept (the report says which); without it, on the blocks, nothing kept."""
    pytest.importorskip("numba")
    model = tiny(vocab="none", weight_type="Q4_0")
    got = {}
    for cache in ("64", None):
        out = tmp_path / f"bench-{cache}.json"
        r = subprocess.run([sys.executable, "-m", "llorch_ref.cli", "bench", "--model", str(model), "--engines", "numba",
                            "--prefill", "8", "--decode", "2", "--repeats", "1", "--threads", "1", "--json", str(out)]
                           + (["--weight-cache-mb", cache] if cache else []), capture_output=True, text=True,
                           timeout=600, env=dict(os.environ, LLORCH_BENCH_VECTOR_REGISTERS="0"))
        assert r.returncode == 0, r.stdout + r.stderr
        got[cache] = (json.loads(out.read_text())["results"][0]["info"], r.stdout)
    info, text = got["64"]
    assert (info["weights"]["budget_mb"], info["weights"]["budget_by"]) == (64, "user") and info["weights"]["used_mb"] > 0
    assert "prompts by BLAS on float32 weights" in text and "held to one thread" not in text
    assert any("BLAS on the float32 weight" in k for k in info["matrix_paths"])
    info, text = got[None]
    assert (info["weights"]["budget_mb"], info["weights"]["used_mb"]) == (0, 0)
    assert "prompts by kernels on the blocks" in text
    assert "threads; held to one thread while a prompt runs on the kernels" in text
    assert not any("BLAS on the float32 weight" in k for k in info["matrix_paths"])


def test_bench_names_llama_cpps_build_and_the_simd_it_leaves_unused(llamacpp):
    """llama.cpp's figures come with its build's CPU features, read from the library itself (the shared wheel: AVX2,
    no AVX-512); where the CPU has AVX-512 that the build does not use, the report says the ratios are against that
    build. An AVX-512 build on the same CPU, or an AVX2 CPU, draws no such line."""
    from llorch_ref.bench import _unused_simd
    from llorch_ref.references.llamacpp import build_features

    build = build_features()
    raw = llamacpp.llama_print_system_info().decode()
    assert build and all(f"{f} = 1" in raw for f in build), (build, raw)
    assert not any(f"{f} = 0" in raw for f in build)
    assert "AVX-512, which this build does not use" in _unused_simd(["SSE3", "AVX", "AVX2"], "avx2 fma avx512f")
    assert _unused_simd(["AVX2", "AVX512", "AVX512_VNNI"], "avx2 avx512f") == ""
    assert _unused_simd(["AVX2"], "avx2 fma f16c") == ""



def test_blas_line_names_numpys_own_library_when_another_is_loaded_first(monkeypatch):
    """A process may hold several BLAS libraries (the GPU host's: another OpenBLAS listed before numpy's in some
    runs); the report names the one numpy multiplies with (numpy.libs), not the first listed."""
    import numpy
    import threadpoolctl

    import llorch_ref.backends as b

    home = os.path.dirname(numpy.__file__)
    other = {"user_api": "blas", "internal_api": "openblas", "version": "0.3.34", "architecture": "Other",
             "num_threads": 16, "filepath": "/opt/x/site-packages/scipy.libs/libscipy_openblas.so"}
    mine = dict(other, version="0.3.31", architecture="Mine", num_threads=2,
                filepath=home + ".libs/libscipy_openblas64_.so")
    monkeypatch.setattr(threadpoolctl, "threadpool_info", lambda: [other, mine])
    assert b.blas_info().startswith("openblas 0.3.31, Mine kernels") and b.blas_info().endswith(", 2 threads")
    monkeypatch.setattr(threadpoolctl, "threadpool_info", lambda: [other])
    assert b.blas_info().startswith("openblas 0.3.34, Other kernels")


def test_bench_load_is_the_median_of_a_load_in_each_of_repeats_processes(tiny, tmp_path):
    """A load is one sample a process: with --repeats 3 each engine is loaded in two more fresh processes, the
    report keeps the three (load_runs) and prints their median and spread."""
    import statistics

    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, "-m", "llorch_ref.cli", "bench", "--model", str(tiny()), "--engines", "numpy",
                        "--prefill", "4", "--decode", "2", "--repeats", "3", "--threads", "1", "--json", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    (x,) = json.loads(out.read_text())["results"]
    assert len(x["load_runs"]) == 3 and all(v > 0 for v in x["load_runs"])
    assert x["load_s"] == statistics.median(x["load_runs"])
    assert f"load {min(x['load_runs']):.2f}-{max(x['load_runs']):.2f} s" in r.stdout


def test_modules_compiled_for_want_of_bytecode_are_named_and_warned_of(tmp_path, monkeypatch):
    """Modules a load imports without bytecode are compiled from source in that load, in every process where none is
    written (the GPU host's image: numpy without bytecode and PYTHONDONTWRITEBYTECODE=1, numpy.ma's 61 ms in each
    numba load there): the bench names them (absent bytecode, or bytecode written during the load) and warns; a
    module read from its bytecode, or one imported before the load, is not named."""
    import importlib.util
    import py_compile
    import time

    from llorch_ref.bench import compiled_from_source, markdown

    pkg = tmp_path / "bytecode_probe"
    pkg.mkdir()
    for name in ("__init__", "early", "cached", "bare", "written"):
        (pkg / f"{name}.py").write_text(f"NAME = {name!r}\n")
    for name in ("__init__", "cached"):           # bytecode as an install leaves it, written before the load
        src = str(pkg / f"{name}.py")
        pyc = importlib.util.cache_from_source(src)
        py_compile.compile(src, cfile=pyc)
        os.utime(pyc, (time.time() - 60, time.time() - 60))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    try:
        import bytecode_probe.early  # noqa: F401
        before, since = dict(sys.modules), time.time()
        import bytecode_probe.bare  # noqa: F401
        import bytecode_probe.cached  # noqa: F401
        monkeypatch.setattr(sys, "dont_write_bytecode", False)
        import bytecode_probe.written  # noqa: F401
        assert os.path.exists(importlib.util.cache_from_source(str(pkg / "written.py")))
        assert compiled_from_source(before, since) == ["bytecode_probe.bare", "bytecode_probe.written"]
    finally:
        for name in [n for n in sys.modules if n.startswith("bytecode_probe")]:
            del sys.modules[name]

    row = {"engine": "llama.cpp", "device": "cpu", "load_s": 0.3, "prefill_tok_s": 1.0, "decode_tok_s": 1.0,
           "peak_mb": 1.0, "compiled_at_load": ["a", "b.x", "b.y", "c", "d", "e"], "compiled_at_load_runs": [6, 6, 0]}
    report = {"model": "m.gguf", "threads": 2, "prefill_tokens": 8, "decode_tokens": 8, "repeats": 3, "results": [row]}
    text = markdown(report)
    assert "warning: llama.cpp's load compiled Python modules that had no bytecode, in 2 of 3 loads" in text
    assert "6 modules at most; the first load's by package: b 2, a 1, c 1, d 1 and 1 more" in text
    row["compiled_at_load_runs"], row["compiled_at_load"] = [0, 0, 0], []
    assert "bytecode" not in markdown(report)
