"""Lazy weights (GGUF memory-mapped, layers dequantized on use, bounded cache) and float16/bfloat16 storage."""
from __future__ import annotations

import numpy as np
import pytest

import llorch_ref
from llorch_ref.errors import ParameterError

PROMPT = "Once upon a time, there was a little"


@pytest.mark.parametrize("kw", [dict(), dict(tied=True), dict(weight_type="Q8_0"), dict(weight_type="Q4_1")])
def test_lazy_equals_eager_bit_for_bit_on_tiny_models(tiny, kw):
    p = tiny(**kw)
    eager = llorch_ref.load(p, weights="eager")
    ids = eager.tokenizer.encode(PROMPT)
    want = eager.logits(ids)
    for mb in (None, 0, 0.05):                       # all cached, nothing cached, about one layer
        lazy = llorch_ref.load(p, weights="lazy", weight_cache_mb=mb)
        assert lazy.weights_info()["lazy"]
        np.testing.assert_array_equal(lazy.logits(ids), want)
        np.testing.assert_array_equal(lazy.logits(ids), want)         # second pass: from the cache (or not)
        st = lazy.weights_info()
        if mb == 0:
            assert st["entries"] == 0 and st["hits"] == 0 and st["misses"] == 2 * (eager.config.n_layers + 1)
        if mb is None:
            assert st["hits"] == eager.config.n_layers + 1 and st["used_mb"] == st["dequantized_mb"]


def test_cache_keeps_what_fits_and_never_exceeds_its_budget(tiny):
    p = tiny(n_layers=4)
    eager = llorch_ref.load(p, weights="eager").weights.layers[0]
    arrays = [a for a in vars(eager).values() if a is not None]          # bq/bk/bv are None on llama
    layer_mb = sum(a.nbytes for a in arrays) / 2**20
    eng = llorch_ref.load(p, weights="lazy", weight_cache_mb=2.5 * layer_mb)
    assert eng.weights.layers.layer_bytes == sum(a.nbytes for a in arrays)
    eng.logits([1, 2, 3])
    st = eng.weights_info()
    assert st["entries"] == 2 and st["used_mb"] <= st["budget_mb"]
    eng.logits([1, 2, 3])
    assert eng.weights_info()["hits"] == 2                   # the first two layers, kept
    from llorch_ref.loaders.lazy_weights import StreamingLayer
    assert isinstance(eng.weights.layers[3], StreamingLayer)   # the others: dequantized per use, not kept
    np.testing.assert_array_equal(eng.weights.layers[3].w_up, eager_layer(p, 3).w_up)


def eager_layer(p, i):
    return llorch_ref.load(p, weights="eager").weights.layers[i]


def test_parallel_chunked_dequantization_is_bit_identical(tiny, monkeypatch):
    import gguf

    from llorch_ref.loaders import gguf_file
    p = tiny(weight_type="Q8_0")
    r = gguf.GGUFReader(str(p))
    t = next(t for t in r.tensors if t.name == "blk.0.ffn_up.weight")
    whole = gguf.quants.dequantize(t.data, t.tensor_type).reshape(96, 64)
    monkeypatch.setattr(gguf_file, "CHUNK_ELEMS", 64 * 5)        # 5-row chunks, the last one short
    np.testing.assert_array_equal(gguf_file.dequantize(t, r), whole)


def test_default_model_lazy_equals_eager(engine_q41, default_model):
    eager = llorch_ref.load(default_model, weights="eager")
    assert engine_q41.weights_info()["lazy"] and not eager.weights_info()["lazy"]
    ids = eager.tokenizer.encode(PROMPT)
    np.testing.assert_array_equal(engine_q41.logits(ids), eager.logits(ids))


@pytest.mark.parametrize("dtype,nmse_max", [("float16", 3.3e-5), ("bfloat16", 3e-3)])
def test_reduced_storage_is_close_but_not_equal(tiny, dtype, nmse_max):
    from llorch_ref.harness.metrics import compare
    p = tiny()
    ref = llorch_ref.load(p, weights="eager")
    ids = ref.tokenizer.encode(PROMPT)
    for weights in ("eager", "lazy"):
        eng = llorch_ref.load(p, weights=weights, weight_dtype=dtype)
        assert eng.weights_info()["storage"] == dtype
        m = compare(eng.logits(ids), ref.logits(ids))
        assert 0 < m["nmse"] < nmse_max, m


@pytest.mark.parametrize("kw,msg", [
    (dict(weights="eager", weight_cache_mb=10), "applies to lazy weights only"),
    (dict(weights="lazy", weight_cache_mb=-1), "must be >= 0"),
    (dict(weights="lazy", numerics="ggml"), "lazy weights need"),
    (dict(weights="sometimes"), "must be 'auto', 'lazy' or 'eager'"),
    (dict(weight_dtype="int4"), "must be one of"),
    (dict(weight_dtype="float16", numerics="ggml", weights="eager"), "do not apply"),
])
def test_weight_options_are_applied_or_rejected(tiny, kw, msg):
    with pytest.raises(ParameterError, match=msg):
        llorch_ref.load(tiny(), **kw)


def test_cli_weight_options(tiny, capsys):
    from llorch_ref.cli import main
    p = str(tiny())
    assert main(["generate", "Once", "--model", p, "--max-tokens", "2", "--weight-cache-mb", "0"]) == 0
    assert "lazy weights" in capsys.readouterr().err
    assert main(["generate", "Once", "--model", p, "--max-tokens", "2", "--weights", "eager",
                 "--weight-cache-mb", "5"]) == 2
    assert "applies to lazy weights only" in capsys.readouterr().err


@pytest.mark.default_model
@pytest.mark.llamacpp
@pytest.mark.parametrize("dtype,band_class", [("float16", "F16"), ("bfloat16", "BF16")])
def test_reduced_storage_passes_its_own_bands_against_llamacpp(llamacpp, default_f32, shared_llama_dumps, dtype,
                                                               band_class):
    """float16 and bfloat16 storage of the F32 copy against llama.cpp on the F32 copy (one dump for both:
    shared_llama_dumps)."""
    from llorch_ref.harness.run import run_diff
    eng = llorch_ref.load(default_f32, weight_dtype=dtype)
    res = run_diff(eng, prompt=PROMPT, n_greedy=8)
    assert res.band_class == band_class
    assert res.first_divergence is None, res.first_divergence
    worst = max(r.metrics.get("nmse", 0) for r in res.rows)
    assert worst > 1e-9                                   # the rounding shows: these are not the F32 figures


@pytest.mark.parametrize("kw", [dict(vocab="bpe", tied=True), dict(vocab="spm", tied=False, n_kv_heads=4)])
def test_lazy_hf_folder_equals_eager(tiny, tmp_path, kw):
    from llorch_ref.convert import convert_gguf_to_hf
    d = convert_gguf_to_hf(tiny(**kw), tmp_path / "hf")
    eager = llorch_ref.load(d)
    assert not eager.weights_info()["lazy"]                      # folders load eagerly unless asked
    ids = eager.tokenizer.encode(PROMPT)
    want = eager.logits(ids)
    for mb in (None, 0):
        lazy = llorch_ref.load(d, weights="lazy", weight_cache_mb=mb)
        assert lazy.weights_info()["lazy"]
        np.testing.assert_array_equal(lazy.logits(ids), want)
    with pytest.raises(ParameterError, match="applies to lazy weights only"):
        llorch_ref.load(d, weight_cache_mb=1)
