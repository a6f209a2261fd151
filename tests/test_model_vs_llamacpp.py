"""The whole forward pass against llama.cpp: tiny random models of every flavour, and the default model."""
from __future__ import annotations

import numpy as np
import pytest

import llorch_ref
from llorch_ref.harness.metrics import compare

PROMPT = "Once upon a time, there was a little"

# NMSE bands for the logits of tiny random models, per weight type (llama.cpp quantizes activations to
# Q8_0 for Q8_0 weights and rounds them to f16 for F16 weights; the reference computes in float32).
TINY_CASES = {
    "mha-f32-bpe": (dict(vocab="bpe", n_heads=4, n_kv_heads=4), 1e-10),
    "gqa-f32-bpe": (dict(vocab="bpe", n_heads=4, n_kv_heads=2), 1e-10),
    "gqa-f32-spm": (dict(vocab="spm", n_heads=4, n_kv_heads=1), 1e-10),
    "gqa-f16-novocab": (dict(vocab="none", weight_type="F16"), 1e-5),
    "mha-q8_0-untied": (dict(vocab="bpe", weight_type="Q8_0", n_kv_heads=4), 5e-3),
    "gqa-mixed-tied": (dict(vocab="bpe", weight_type="mixed", tied=True), 5e-3),
    "gqa-f32-3layers-eps1e-6": (dict(vocab="none", n_layers=3, rms_eps=1e-6, rope_base=500000.0), 1e-10),
}


@pytest.mark.parametrize("case", list(TINY_CASES))
def test_tiny_model_logits_match_llamacpp(tiny, llamacpp, case):
    from llorch_ref.references.llamacpp import LlamaCpp

    kw, band = TINY_CASES[case]
    path = tiny(**kw)
    eng = llorch_ref.load(path)
    ids = [1, 17, 5, 99, 42, 7, 64, 3, 120, 11]
    m = compare(eng.logits(ids), LlamaCpp(path, n_ctx=128).eval(ids))
    print(f"{case}: nmse {m['nmse']:.3e} max_abs {m['max_abs']:.3e} cosine {m['cosine']:.9f} (band {band})")
    assert m["nmse"] <= band
    # and the band is tight enough to catch a real change: the other RoPE pair layout fails it
    other = llorch_ref.load(path)
    import dataclasses
    other.config = dataclasses.replace(other.config, rope_style="neox")
    assert compare(other.logits(ids), LlamaCpp(path, n_ctx=128).eval(ids))["nmse"] > band


def test_tiny_model_generates_text(tiny):
    eng = llorch_ref.load(tiny(vocab="bpe"))
    out = "".join(eng.generate("Once upon", max_tokens=8, ignore_eos=True))
    assert isinstance(out, str) and len(out) > 0


def test_default_f32_logits_match_llamacpp(engine_f32, default_f32, llamacpp):
    """Every position of the prompt, against llama.cpp on the same F32 file (F32 KV, flash attention off)."""
    from llorch_ref.references.llamacpp import LlamaCpp

    ids = engine_f32.tokenizer.encode(PROMPT)
    ours, ref = engine_f32.logits(ids), LlamaCpp(default_f32, n_ctx=256, kv_dtype="float32").eval(ids)
    m = compare(ours, ref)
    print(f"default model F32 copy, {len(ids)} positions: max_abs {m['max_abs']:.3e} nmse {m['nmse']:.3e} "
          f"cosine {m['cosine']:.12f}")
    assert ours.shape == (len(ids), 49152) and ours.dtype == np.float32
    assert m["nmse"] < 1e-10
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


def test_default_greedy_64_equals_llamacpp(engine_q41, default_model, llamacpp):
    """The Q4_1 default model, greedy, 64 tokens, against llama-cpp-python's high-level API at temperature 0: equal
    text and ids (the shared AVX2 wheel), or equal until a near tie flips. Exact mode does not quantize activations,
    so where llama.cpp's top candidates lie within its error the pick may differ: a native AVX-512 build flips at
    token 13, where this engine's logits for the two picks differ by 0.053 (docs/validation.md). A flip is allowed
    only after 8 equal tokens and where the two picks' logits here lie within 0.25 (a quarter of exact mode's largest
    logit error against llama.cpp on this model, 1.0 on an f16 cache)."""
    llm = llamacpp.Llama(str(default_model), n_ctx=512, n_threads=2, verbose=False, seed=0)
    ref = llm.create_completion(PROMPT, max_tokens=64, temperature=0.0)["choices"][0]["text"]
    prompt_ids = engine_q41.tokenizer.encode(PROMPT)
    ids = list(engine_q41.generate_ids(prompt_ids, max_tokens=64))
    ref_ids = llm.tokenize(ref.encode(), add_bos=False, special=True)
    ours = engine_q41.tokenizer.decode(ids)
    print(f"ours: {ours!r}\nllama.cpp: {ref!r}")
    assert len(ids) == 64
    flip = next((i for i, (a, b) in enumerate(zip(ids, ref_ids)) if a != b), None)
    if flip is None:
        assert ours == ref and ids == ref_ids
        return
    lg = engine_q41.logits(prompt_ids + ids[:flip])[-1]
    gap = float(lg[ids[flip]] - lg[ref_ids[flip]])
    print(f"first difference at token {flip + 1}: ours {ids[flip]}, llama.cpp's {ref_ids[flip]}, logits apart {gap}")
    assert flip >= 8 and 0.0 <= gap < 0.25, (flip, gap)


@pytest.mark.slow
def test_f32_greedy_128_equals_llamacpp(engine_f32, default_f32, llamacpp):
    """The F32 copy's 128 greedy tokens from PROMPT equal llama.cpp's (about 20 s of NumPy decode steps on 2 cores:
    with `-m slow`). The default run checks the first 32 of them: the checkpoint runs' diff_f32 (the same prompt,
    32 greedy tokens, checkpoint 12's F32 band an agreement of 1.0: test_checkpoint_12_greedy_text::test_f32_copy)."""
    from llorch_ref.references.llamacpp import LlamaCpp

    ids = engine_f32.tokenizer.encode(PROMPT)
    ours = list(engine_f32.generate_ids(ids, max_tokens=128, ignore_eos=True))
    ref = LlamaCpp(default_f32, n_ctx=512, kv_dtype="float32").greedy(ids, 128)
    assert ours == ref


def test_generate_stops_at_eos(engine_q41):
    from llorch_ref.engine import GenerationResult

    res = GenerationResult()
    text = "".join(engine_q41.generate("What is 2+2?", chat=True, max_tokens=200, result=res))
    assert res.stop_reason == "eos"
    assert "<|im_end|>" not in text and len(res.token_ids) < 200


def test_generate_rejects_unsupported_parameters(engine_q41):
    from llorch_ref.errors import ParameterError, PromptError

    with pytest.raises(ParameterError, match="temperature"):
        list(engine_q41.generate("hi", temperature=-0.7))
    with pytest.raises(ParameterError, match="unknown sampling parameter"):
        list(engine_q41.generate("hi", temprature=0.7))
    with pytest.raises(ParameterError, match="max_tokens"):
        list(engine_q41.generate("hi", max_tokens=-1))
    with pytest.raises(PromptError, match="empty prompt"):
        list(engine_q41.generate(""))
