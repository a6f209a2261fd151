"""The cupy backend's op table (cuda_ops.CudaOps), GGUF blocks dequantized into float16 for the tensor-core prompt
products, and the cupy backend as eval's reference: against the numpy oracle. GPU tests skip without cupy."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from llorch_test_helpers import need_backend

import llorch_ref
from llorch_ref.model import layers
from llorch_ref.testing.blocks import random_qtensor

TYPES = ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K"]
TEXT = ("It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of "
        "foolishness, it was the epoch of belief, it was the epoch of incredulity. ") * 8


def test_cuda_ops_carries_every_layer_function_and_overrides_the_hot_ones():
    need_backend("cupy")
    import cupy as cp

    from llorch_ref.backends.cuda_ops import CudaOps

    ops = CudaOps(layers, cp, "float32")
    public = {n for n in dir(layers) if not n.startswith("_")}
    assert public <= set(dir(ops))
    assert ops.rope_angles is layers.rope_angles and ops.softmax is layers.softmax
    for name in ("linear", "qkv", "rms_norm", "rope", "attention", "swiglu", "geglu", "kv_head_of"):
        assert getattr(ops, name).__func__ is getattr(CudaOps, name), name
    assert ops.fusions.add_norm == ops.add_norm and not ops.unwatched and not ops.static_decode


@pytest.mark.parametrize("qt", TYPES)
def test_blocks_dequantized_to_float16_round_gguf_py_s_floats(qt):
    """dequant16: gguf-py's float32 weights rounded to nearest float16, to the bit; the tensor-core product of three
    rows (float16 weights and activations, float32 accumulation) within float16 rounding of the float64 product."""
    need_backend("cupy")
    import cupy as cp

    from llorch_ref.backends.cuda_blocks import GpuBlocks

    q = random_qtensor(qt, 72, 768, 4)
    g = GpuBlocks.from_qtensor(q, cp)
    half = cp.asnumpy(g.dequantize("float16"))
    assert half.dtype == np.float16
    np.testing.assert_array_equal(half, q.dequantize().astype(np.float16))
    deq = q.dequantize().astype(np.float64)
    x = np.random.default_rng(5).standard_normal((3, 768)).astype(np.float32)
    want, scale = x @ deq.T, np.abs(x) @ np.abs(deq).T
    got = cp.asnumpy(g.matmul(cp.asarray(x), half=True))
    err = np.abs(got - want) / scale
    assert got.dtype == np.float32 and 0 < err.max() <= 2 ** -9, float(err.max())
    exact = cp.asnumpy(g.matmul(cp.asarray(x)))
    assert (np.abs(exact - want) <= 1e-6 * scale).all()


@pytest.mark.parametrize("weight_type", ["Q4_0", "Q8_0", "k_mixed"])
def test_blocks_prefill_nobody_watches_runs_on_float16_within_the_float16_band(tiny, weight_type):
    """--dtype blocks: a prompt no recorder watches (generation, eval's logits) takes the float16 tensor-core products
    and attention; a recorded one the float32 products. Logits of a prompt in two parts (the second over a cached
    prefix) within the cupy:float16 band of the recorded path's, and not equal to them (the half path ran); the
    recorded path against numpy within the float32 band; greedy tokens after the prompt equal numpy's."""
    need_backend("cupy")
    import cupy as cp

    d = 256 if weight_type == "k_mixed" else 128
    path = tiny(vocab="bpe", d_model=d, d_ff=2 * d, n_heads=4, n_kv_heads=2, weight_type=weight_type)
    ids = [(7 * i + 3) % 200 + 1 for i in range(53)]
    eng = llorch_ref.load(path, backend="cupy", dtype="blocks")
    ref = llorch_ref.load(path)
    out = {}
    for watched in (False, True):
        record = (lambda name, layer, arr: None) if watched else None
        cache = eng.new_cache()
        a = eng.forward(ids[:20], cache, record=record)
        b = eng.forward(ids[20:], cache, record=record)
        out[watched] = np.concatenate([cp.asnumpy(a), cp.asnumpy(b)]).astype(np.float64)
    want = ref.forward(ids, ref.new_cache()).astype(np.float64)

    def nmse(x, y):
        return float(((x - y) ** 2).sum() / (y ** 2).sum())
    print(f"{weight_type}: unwatched {nmse(out[False], out[True]):.2e}, recorded vs numpy {nmse(out[True], want):.2e}")
    assert 0.0 < nmse(out[False], out[True]) < 1e-3
    assert nmse(out[True], want) < 1e-9
    assert list(eng.generate_ids(ids, 8, ignore_eos=True)) == list(ref.generate_ids(ids, 8, ignore_eos=True))


def cli(*a):
    return subprocess.run([sys.executable, "-m", "llorch_ref.cli", *map(str, a)], capture_output=True, text=True,
                          timeout=600)


def test_eval_reference_on_cupy_gives_numpy_s_statistics(tiny, tmp_path):
    """eval --reference-backend cupy: the same chunks scored against the GPU reference as against numpy's (float32
    both): KLD of numpy's logits against the GPU's near 0, every top token the same, perplexities equal to 1e-6."""
    need_backend("cupy")
    path = tiny(weight_type="Q8_0", n_layers=2, vocab="bpe", context_length=256)
    text = tmp_path / "t.txt"
    text.write_text(TEXT, encoding="utf-8")
    got = {}
    for backend in ("numpy", "cupy"):
        r = cli("eval", "--model", path, "--subject", "numpy", "--text", text, "--ctx", 64, "--reference-backend",
                backend, "--json", tmp_path / f"{backend}.json")
        assert r.returncode == 0, r.stderr
        got[backend] = json.loads((tmp_path / f"{backend}.json").read_text())
    s = got["cupy"]["statistics"]
    assert "cupy" in got["cupy"]["reference"] and s["Mean KLD"][0] < 1e-8 and s["Same top p"][0] == 1.0
    assert s["Mean PPL(Q)"][0] == pytest.approx(got["numpy"]["statistics"]["Mean PPL(Q)"][0], rel=1e-6)


def test_eval_reference_on_cupy_refuses_ggml_numerics_in_one_line(tiny, tmp_path):
    path = tiny(weight_type="Q8_0", n_layers=2, vocab="bpe", context_length=256)
    r = cli("eval", "--model", path, "--subject", "numpy", "--text", tmp_path / "none.txt", "--reference-backend",
            "cupy", "--reference-numerics", "ggml")
    assert r.returncode == 2 and r.stderr.startswith("error: ") and "Traceback" not in r.stderr, r.stderr
    assert "--reference-backend cupy" in r.stderr
