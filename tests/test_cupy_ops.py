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
def test_blocks_dequantized_to_float16_parts_round_gguf_py_s_floats(qt):
    """dequant16: gguf-py's float32 weights rounded to nearest float16, to the bit; dequant_split: hi that rounding
    and lo = fp16((w - hi) * 2^11), so hi + lo * 2^-11 is w to 2^-22 relative. Three rows: the float16 product
    within float16 rounding of the float64 product, the split product within float32's (1e-6 of sum |x w|), as the
    float32 product."""
    need_backend("cupy")
    import cupy as cp

    from llorch_ref.backends.cuda_blocks import GpuBlocks

    q = random_qtensor(qt, 72, 768, 4)
    g = GpuBlocks.from_qtensor(q, cp)
    w32 = q.dequantize()
    half = cp.asnumpy(g.dequantize("float16"))
    np.testing.assert_array_equal(half, w32.astype(np.float16))
    split = cp.asnumpy(g.dequantize("split"))
    assert split.shape == (72, 2 * 768) and split.dtype == np.float16
    np.testing.assert_array_equal(split[:, :768], half)
    back = split[:, :768].astype(np.float64) + split[:, 768:].astype(np.float64) / 2048
    assert (np.abs(back - w32) <= 2.0 ** -21 * np.abs(w32) + 2.0 ** -35).all()
    deq = w32.astype(np.float64)
    x = np.random.default_rng(5).standard_normal((3, 768)).astype(np.float32)
    want, scale = x @ deq.T, np.abs(x) @ np.abs(deq).T
    for prompt, bound in (("float16", 2 ** -9), ("split", 1e-6), ("float32", 1e-6)):
        got = cp.asnumpy(g.matmul(cp.asarray(x), prompt))
        err = (np.abs(got - want) / scale).max()
        assert got.dtype == np.float32 and err <= bound, (prompt, float(err))
        if prompt == "float16":
            assert err > 1e-6                         # the float16 rounding is there: this path ran


@pytest.mark.parametrize("weight_type", ["Q4_0", "Q8_0", "k_mixed"])
def test_blocks_prompts_nobody_watches_run_on_tensor_cores_within_their_bands(tiny, weight_type):
    """--dtype blocks: a prompt no recorder watches (generation, eval's logits) multiplies on tensor cores, a recorded
    one in float32. Logits of a prompt in two parts (the second over a cached prefix): the split products within the
    float32 band (1e-9) of the recorded path's and not equal to them (that path ran); blocks_prompt "float16" within
    float16's band (1e-3) and outside float32's; the recorded path against numpy within float32's; greedy tokens
    after the prompt equal numpy's."""
    need_backend("cupy")
    import cupy as cp

    d = 256 if weight_type == "k_mixed" else 128
    path = tiny(vocab="bpe", d_model=d, d_ff=2 * d, n_heads=4, n_kv_heads=2, weight_type=weight_type)
    ids = [(7 * i + 3) % 200 + 1 for i in range(53)]
    eng = llorch_ref.load(path, backend="cupy", dtype="blocks")
    ref = llorch_ref.load(path)

    def logits(record):
        cache = eng.new_cache()
        a = eng.forward(ids[:20], cache, record=record)
        b = eng.forward(ids[20:], cache, record=record)
        return np.concatenate([cp.asnumpy(a), cp.asnumpy(b)]).astype(np.float64)

    def nmse(x, y):
        return float(((x - y) ** 2).sum() / (y ** 2).sum())
    recorded, split = logits(lambda name, layer, arr: None), logits(None)
    eng.ops.blocks_prompt = "float16"
    half = logits(None)
    eng.ops.blocks_prompt = "split"
    want = ref.forward(ids, ref.new_cache()).astype(np.float64)
    print(f"{weight_type}: split {nmse(split, recorded):.2e}, float16 {nmse(half, recorded):.2e}, "
          f"recorded vs numpy {nmse(recorded, want):.2e}")
    assert 0.0 < nmse(split, recorded) < 1e-9
    assert 1e-9 < nmse(half, recorded) < 1e-3
    assert nmse(recorded, want) < 1e-9
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
