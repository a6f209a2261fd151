"""llama.cpp's n_gpu_layers (--gpu-layers): refused with one line and exit 2 where llama-cpp-python has no GPU
backend (dump, eval, diff); a dump made with layers on the GPU declares no reproducible arithmetic and is judged
without the local comparison; n_gpu_layers 0 passes llama.cpp the settings and gives the dump of a call
without it. The GPU itself is not here: the declaration is checked on the CPU build, told it can offload."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from llorch_ref.dump import load_dump
from llorch_ref.errors import ParameterError


def cli(*a, timeout=300):
    return subprocess.run([sys.executable, "-m", "llorch_ref.cli", *map(str, a)], capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def cpu_build():
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    if llama_cpp.llama_supports_gpu_offload():
        pytest.skip("this llama-cpp-python has a GPU backend: the refusal is for a CPU build")
    return llama_cpp


@pytest.fixture(scope="module")
def model(tiny):
    return tiny(weight_type="F32", n_layers=2, vocab="bpe")


@pytest.mark.parametrize("args", [
    ("dump", "--engine", "llamacpp", "--gpu-layers", "99", "--out", "{tmp}/d.safetensors"),
    ("eval", "--subject", "llamacpp", "--gpu-layers", "99", "--json", "{tmp}/e.json"),
    ("diff", "--gpu-layers", "99", "--json"),
])
def test_gpu_layers_on_a_cpu_build_is_one_line_and_exit_2(cpu_build, model, tmp_path, args):
    r = cli(*(a.format(tmp=tmp_path) for a in args), "--model", model)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr[-2000:]
    assert lines[0].startswith("error: --gpu-layers 99: the installed llama-cpp-python has no GPU backend")
    assert list(tmp_path.iterdir()) == []                          # refused before anything was written


def test_gpu_layers_is_a_llamacpp_setting_only(model, tmp_path):
    r = cli("eval", "--subject", "numpy", "--gpu-layers", "99", "--model", model)
    assert r.returncode == 2 and r.stderr.strip() == "error: --gpu-layers: not a setting of --subject numpy"
    r = cli("diff", "--reference", "numpy", "--backend", "numba", "--gpu-layers", "9", "--model", model)
    assert r.returncode == 2 and r.stderr.strip().startswith("error: --gpu-layers: for a comparison with llama.cpp")
    r = cli("dump", "--engine", "llorch", "--gpu-layers", "9", "--model", model, "--out", tmp_path / "d.safetensors")
    assert r.returncode == 2 and r.stderr.strip().startswith("error: --gpu-layers: llama.cpp settings")


@pytest.fixture
def params(cpu_build, monkeypatch):
    """The model and context parameters llama.cpp is handed, as (n_gpu_layers, offload_kqv) per context made."""
    seen, load, init = [], cpu_build.llama_model_load_from_file, cpu_build.llama_init_from_model

    def load_spy(path, mp):
        seen.append([mp.n_gpu_layers])
        return load(path, mp)

    def init_spy(m, cp):
        seen[-1].append(bool(cp.offload_kqv))
        return init(m, cp)
    monkeypatch.setattr(cpu_build, "llama_model_load_from_file", load_spy)
    monkeypatch.setattr(cpu_build, "llama_init_from_model", init_spy)
    return seen


def test_zero_gpu_layers_is_the_cpu_run_unchanged(params, model):
    from llorch_ref.references.engines import dump_llamacpp
    ids = [1, 5, 9, 14, 3, 7]
    plain = dump_llamacpp(model, token_ids=ids, n_greedy=4).to_dump()
    zero = dump_llamacpp(model, token_ids=ids, n_greedy=4, n_gpu_layers=0).to_dump()
    assert params == [[0, False], [0, False]]
    assert zero.arithmetic == plain.arithmetic and zero.arithmetic["numerics"] == "ggml"
    assert "n_gpu_layers" not in zero.arithmetic["settings"] and zero.manifest["notes"] == plain.manifest["notes"]
    assert sorted(zero.tensors) == sorted(plain.tensors) and len(plain.tensors) > 20
    assert all(np.array_equal(zero.tensors[k], plain.tensors[k]) for k in plain.tensors)


@pytest.fixture
def offloading(cpu_build, monkeypatch, params):
    """The CPU build told it has a GPU backend: it runs the layers on the CPU, with the GPU settings asked."""
    monkeypatch.setattr(cpu_build, "llama_supports_gpu_offload", lambda: True)
    return params


def test_a_dump_with_gpu_layers_declares_no_reproducible_arithmetic(offloading, model):
    from llorch_ref.references.engines import dump_llamacpp
    d = dump_llamacpp(model, token_ids=[1, 5, 9, 14], n_greedy=2, n_gpu_layers=99).to_dump()
    assert offloading == [[99, True]]
    ar = d.arithmetic
    assert ar["numerics"] == "exact" and ar["reproducible"] is False and "ggml_simd" not in ar
    assert ar["settings"]["n_gpu_layers"] == 99 and ar["settings"]["offload_kqv"] is True
    assert "99 layers on the GPU" in d.manifest["notes"]


def test_such_a_dump_is_judged_without_the_local_comparison(offloading, model, tmp_path):
    import llorch_ref
    from llorch_ref.harness import run as harness_run
    from llorch_ref.references.engines import dump_llamacpp
    rec = dump_llamacpp(model, token_ids=[1, 5, 9, 14, 2, 8], n_greedy=2, n_gpu_layers=99)
    rec.save(tmp_path / "gpu.safetensors")
    sub = load_dump(tmp_path / "gpu.safetensors")
    eng = llorch_ref.load(model)
    res = harness_run.run_subject(eng, sub)
    v = res.verdict()
    assert res.local_declaration is None and v.compared > 20 and v.diverging == 0
    assert res.band_class == "F32+cuda"                          # the bands measured on llama.cpp's GPU backend
    rec.extra["arithmetic"] = {k: v for k, v in rec.extra["arithmetic"].items() if k != "reproducible"}
    rec.save(tmp_path / "planted.safetensors")                  # the same dump declaring exact float32
    planted = harness_run.run_subject(eng, load_dump(tmp_path / "planted.safetensors"))
    assert planted.local_declaration == "exact/float32" and planted.band_class == "F32"


def test_a_planted_weight_in_such_a_dump_fails_by_the_gpu_bands(offloading, model, tmp_path):
    import llorch_ref
    from llorch_ref.harness import run as harness_run
    from llorch_ref.references.engines import dump_llamacpp
    from llorch_ref.testing.plant import plant_scale
    bad = plant_scale(model, tmp_path / "planted.gguf", "blk.1.ffn_up.weight", 1.05)
    sub = dump_llamacpp(bad, token_ids=[1, 5, 9, 14, 2, 8], n_greedy=2, n_gpu_layers=99).to_dump()
    res = harness_run.run_subject(llorch_ref.load(model), sub)
    v = res.verdict()
    assert res.band_class == "F32+cuda" and v.status == "FAIL", v.line()
    assert (v.first_divergence["checkpoint"], v.first_divergence["layer"]) == ("6", 1), v.first_divergence


def test_diff_subject_says_the_dump_is_judged_end_to_end(offloading, model, tmp_path):
    from llorch_ref.references.engines import dump_llamacpp
    dump_llamacpp(model, prompt="the cat sat on the mat", n_greedy=2, n_gpu_layers=99).save(tmp_path / "g.safetensors")
    r = cli("diff", "--model", model, "--subject", tmp_path / "g.safetensors", "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "declares no reproducible arithmetic (llama.cpp's GPU backend, 99 layers)" in r.stderr
    out = json.loads(r.stdout)
    assert out["verdict"]["local_declaration"] is None


def test_the_setting_reaches_llamacpp_from_eval_and_diff(offloading, model):
    import llorch_ref
    from llorch_ref.harness.run import run_diff
    from llorch_ref.references.logit_sources import SourceSpec
    SourceSpec("llamacpp", str(model), {"n_gpu_layers": 7}).build(64)
    res = run_diff(llorch_ref.load(model), token_ids=[1, 5, 9, 14], n_greedy=2, n_gpu_layers=7)
    assert offloading == [[7, True], [7, True]] and res.recipe["n_gpu_layers"] == 7
    assert res.band_class == "F32+cuda"


def test_a_negative_count_is_refused():
    from llorch_ref.references.llamacpp import check_gpu_layers
    with pytest.raises(ParameterError, match="0 or more"):
        check_gpu_layers(-1)
    assert check_gpu_layers(None) == 0
