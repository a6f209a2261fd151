"""Layer functions against independent float64 formulas and invariants."""
from __future__ import annotations

import numpy as np
import pytest

import llorch_ref
from llorch_ref.model import layers as L
from llorch_ref.model.cache import Cache
from llorch_ref.model.forward import forward

xp = np


def test_rms_norm_matches_float64_formula():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 64)).astype(np.float32)
    w = rng.standard_normal(64).astype(np.float32)
    y = L.rms_norm(xp, x, w, 1e-5)
    x64 = x.astype(np.float64)
    ref = x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + 1e-5) * w
    assert y.dtype == np.float32
    np.testing.assert_allclose(y, ref, rtol=2e-6, atol=1e-6)
    assert np.abs(L.rms_norm(xp, x, w, 1e-1) - y).max() > 1e-3     # epsilon is really applied


def _rope_ref(x, pos, base, style):
    """Independent float64 RoPE using complex numbers."""
    t, nh, hd = x.shape
    freqs = base ** (-np.arange(0, hd, 2) / hd)
    ang = np.exp(1j * np.outer(pos, freqs))[:, None, :]
    if style == "adjacent":
        z = x[..., 0::2] + 1j * x[..., 1::2]
        z = z * ang
        out = np.empty_like(x, dtype=np.float64)
        out[..., 0::2], out[..., 1::2] = z.real, z.imag
    else:
        z = x[..., : hd // 2] + 1j * x[..., hd // 2:]
        z = z * ang
        out = np.concatenate([z.real, z.imag], -1)
    return out


@pytest.mark.parametrize("style", ["adjacent", "neox"])
def test_rope_matches_complex_rotation(style):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((6, 3, 16)).astype(np.float32)
    cos, sin = L.rope_angles(xp, 32, 16, 10000.0)
    pos = np.arange(10, 16)
    y = L.rope(xp, x, cos[pos], sin[pos], style)
    np.testing.assert_allclose(y, _rope_ref(x.astype(np.float64), pos, 10000.0, style), atol=2e-5)
    np.testing.assert_allclose(np.linalg.norm(y, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-5)


def test_rope_styles_differ_by_the_llamacpp_permutation():
    """HF (neox) weights permuted the way llama.cpp's converter does give the same rotated values."""
    rng = np.random.default_rng(2)
    hd = 16
    x = rng.standard_normal((4, 2, hd)).astype(np.float32)
    cos, sin = L.rope_angles(xp, 8, hd, 10000.0)
    neox = L.rope(xp, x, cos[:4], sin[:4], "neox")
    perm = np.arange(hd).reshape(2, hd // 2).T.reshape(-1)      # [0, 8, 1, 9, ...]: half-split -> adjacent
    adj = L.rope(xp, x[..., perm], cos[:4], sin[:4], "adjacent")
    np.testing.assert_allclose(adj, neox[..., perm], atol=1e-6)
    assert not np.allclose(L.rope(xp, x, cos[:4], sin[:4], "adjacent"), neox, atol=1e-3)


def test_gqa_kv_head_mapping_equals_repeat():
    kvh = L.kv_head_of(xp, 9, 3)
    assert kvh.tolist() == np.repeat(np.arange(3), 3).tolist()


def test_softmax_sums_to_one_and_handles_masks():
    s = np.array([[0.0, 1.0, -np.inf], [3.0, 3.0, 3.0]], dtype=np.float32)
    p = L.softmax(xp, s)
    assert p.dtype == np.float32
    np.testing.assert_allclose(p.sum(-1), 1.0, rtol=1e-6)
    assert p[0, 2] == 0.0


def test_causal_future_tokens_do_not_change_past_logits(tiny):
    eng = llorch_ref.load(tiny(vocab="none"))
    a = eng.logits([3, 5, 7, 9, 11])
    b = eng.logits([3, 5, 7, 100, 2])
    np.testing.assert_array_equal(a[:3], b[:3])
    assert np.abs(a[3:] - b[3:]).max() > 1e-4


def test_incremental_decode_matches_full_forward(tiny):
    eng = llorch_ref.load(tiny(vocab="none", n_kv_heads=2))
    ids = [4, 8, 15, 16, 23, 42]
    full = eng.logits(ids)
    cache = eng.new_cache()
    step = [forward(xp, eng.config, eng.weights, ids[:3], cache)[-1]]
    for t in ids[3:]:
        step.append(forward(xp, eng.config, eng.weights, [t], cache)[-1])
    np.testing.assert_allclose(np.stack(step), full[2:], rtol=1e-4, atol=1e-5)


def test_cache_reset_gives_identical_results(tiny):
    eng = llorch_ref.load(tiny(vocab="none"))
    cache = eng.new_cache()
    forward(xp, eng.config, eng.weights, [9, 9, 9, 9, 9, 9, 9], cache)
    cache.reset()
    assert cache.pos == 0 and not cache.k.any()
    again = forward(xp, eng.config, eng.weights, [1, 2, 3], cache)
    np.testing.assert_array_equal(again, eng.logits([1, 2, 3]))


def test_every_recorded_tensor_is_float32(tiny):
    eng = llorch_ref.load(tiny(vocab="none"))
    seen = {}
    eng.logits([1, 2, 3], record=lambda n, l, a: seen.setdefault((n, l), a.dtype))
    assert len(seen) > 20
    assert {str(d) for d in seen.values()} == {"float32"}


def test_cache_dtype_is_explicit(tiny):
    eng = llorch_ref.load(tiny(vocab="none"))
    c = Cache(np, eng.config, 16)
    assert c.k.dtype == np.float32 and c.cos.dtype == np.float32
    with pytest.raises(llorch_ref.errors.PromptError, match="context full"):
        forward(np, eng.config, eng.weights, list(range(17)), c)


def test_caches_share_read_only_rope_tables_built_once_per_shape(tiny):
    """A new cache per prompt takes the RoPE tables built for the first one of its shape (they cost 3% of a
    128-token prefill rebuilt), the same values as built anew, read-only; another base gets its own tables."""
    import dataclasses

    eng = llorch_ref.load(tiny(vocab="none"))
    cfg = eng.config
    a, b = eng.new_cache(), eng.new_cache()
    assert a.cos is b.cos and a.sin is b.sin
    fresh = L.rope_angles(np, a.n_ctx, cfg.rope_dim, cfg.rope_base, cfg.rope_freq_scale, cfg.rope_freq_factors)
    np.testing.assert_array_equal(a.cos, fresh[0])
    np.testing.assert_array_equal(a.sin, fresh[1])
    with pytest.raises(ValueError, match="read-only"):
        a.cos[0, 0] = 2.0
    other = Cache(np, dataclasses.replace(cfg, rope_base=cfg.rope_base * 2), a.n_ctx)
    assert not np.array_equal(other.cos, a.cos)


def _anon_mib():
    with open("/proc/self/status") as f:
        return int(next(ln for ln in f if ln.startswith("RssAnon:")).split()[1]) / 1024


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/status"), reason="reads Linux's /proc")
def test_a_large_cache_commits_memory_only_for_the_positions_written():
    """A 7B-like cache (32 layers, 2048 positions, 8 KV heads of 128: 512 MiB each of K and V) commits a few
    pages for one token per layer, not numpy's 2 MiB huge pages (which made a 7B prefill's peak 260 MB higher)."""
    from types import SimpleNamespace

    cfg = SimpleNamespace(n_layers=32, n_kv_heads=8, head_dim=128, rope_dim=128, rope_base=10000.0,
                          rope_freq_scale=1.0, rope_freq_factors=None, rope_attn_factor=1.0, rope_yarn_ramp=None,
                          rope_base_local=None)
    before = _anon_mib()
    c = Cache(np, cfg, 2048)
    k = np.ones((1, 8, 128), np.float32)
    for layer in range(32):
        c.store(layer, k, k)
    grown = _anon_mib() - before
    assert grown < 16, f"{grown:.1f} MiB committed for one position of 32 layers"
    assert c.k[5, 0, 3, 7] == 1 and c.k[5, 1].sum() == 0 and c.v.shape == (32, 2048, 8, 128)
