"""pytest-benchmark suites per layer at the default model's sizes (D=576, H=9, KV=3, Hd=64, F=1536).

Timings are reported by pytest-benchmark (`pytest tests/benchmarks --benchmark-only`), never asserted;
each benchmark checks its result against the plain formula so it cannot time a wrong kernel.
"""
from __future__ import annotations

import numpy as np
import pytest

from llorch_ref.model import layers as L

rng = np.random.default_rng(0)
T, D, H, KV, HD, F, S = 1, 576, 9, 3, 64, 1536, 256


@pytest.mark.parametrize("t", [1, 128])
def test_rms_norm(benchmark, t):
    x, w = rng.standard_normal((t, D)).astype(np.float32), rng.standard_normal(D).astype(np.float32)
    y = benchmark(L.rms_norm, np, x, w, 1e-5)
    np.testing.assert_allclose(y, x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-5) * w,
                               rtol=1e-5, atol=1e-6)


def test_rope(benchmark):
    cos, sin = L.rope_angles(np, S, HD, 100000.0)
    q = rng.standard_normal((128, H, HD)).astype(np.float32)
    y = benchmark(L.rope, np, q, cos[:128], sin[:128], "adjacent")
    np.testing.assert_allclose(np.linalg.norm(y, axis=-1), np.linalg.norm(q, axis=-1), rtol=1e-5)


def test_attention_decode(benchmark):
    q = rng.standard_normal((1, H, HD)).astype(np.float32)
    k, v = (rng.standard_normal((S, KV, HD)).astype(np.float32) for _ in range(2))
    mask = np.zeros((1, S), np.float32)
    out, _, probs = benchmark(L.attention, np, q, k, v, mask, HD ** -0.5, L.kv_head_of(np, H, KV))
    np.testing.assert_allclose(probs.sum(-1), 1.0, rtol=1e-5)
    assert out.shape == (1, H * HD)


def test_swiglu(benchmark):
    x = rng.standard_normal((1, D)).astype(np.float32)
    wg, wu = (rng.standard_normal((F, D)).astype(np.float32) * 0.05 for _ in range(2))
    wd = rng.standard_normal((D, F)).astype(np.float32) * 0.05
    out, h = benchmark(L.swiglu, np, x, wg, wu, wd)
    g = x @ wg.T
    np.testing.assert_allclose(h, g / (1 + np.exp(-g)) * (x @ wu.T), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("kind", ["numpy-f32", "numba-q4_1"])
def test_linear_decode_ffn_up(benchmark, kind):
    import gguf

    w = rng.standard_normal((F, D)).astype(np.float32)
    raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q4_1)
    deq = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_1)
    x = rng.standard_normal((1, D)).astype(np.float32)
    if kind == "numpy-f32":
        y = benchmark(L.linear, np, x, deq)
    else:
        pytest.importorskip("numba", reason="numba is not installed")
        from llorch_ref.backends.numba_backend import KernelBlocks
        from llorch_ref.model.qtensor import QTensor
        qb = KernelBlocks([QTensor("Q4_1", (raw.shape[0], D), raw)])
        y = benchmark(qb.matvec, x[0])[None]
    np.testing.assert_allclose(y, x @ deq.T, rtol=1e-4, atol=1e-4)
