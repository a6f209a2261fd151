"""Teacher-forced (local) comparison: a 1% scale error planted in one weight matrix of a quantized model is
named at its own checkpoint and layer, where the end-to-end bands of quantized weights let it through; the
clean model raises no alarm. Subjects: llorch-ref itself (exact arithmetic) and llama.cpp (ggml arithmetic,
declared in its dump)."""
from __future__ import annotations

import pytest

import llorch_ref
from llorch_ref.checkpoints import engine_band_class
from llorch_ref.dump import load_dump
from llorch_ref.harness.compare import compare_dumps
from llorch_ref.references.llorch import record_engine
from llorch_ref.testing.plant import plant_scale

PROMPTS = ["Once upon a time", "The cat sat on the mat", "one two three four five", "Hello world, this is",
           "a b c d e f g"]
EXPECT = {"attn_q": ("2", "q_proj"), "attn_k": ("2", "k_proj"), "attn_v": ("2", "v"), "attn_output": ("5", "attn_out"),
          "ffn_gate": ("6", "ffn_swiglu"), "ffn_up": ("6", "ffn_swiglu"), "ffn_down": ("6", "ffn_out")}


@pytest.fixture(scope="module")
def q8(tiny):
    return tiny(weight_type="Q8_0", n_layers=3, d_model=128, d_ff=192, vocab="bpe")


@pytest.fixture(scope="module")
def ref_engine(q8):
    return llorch_ref.load(q8, weights="eager")


def where(fd):
    return None if fd is None else (fd["checkpoint"], fd["layer"], fd["tensor"])


@pytest.mark.parametrize("matrix", list(EXPECT))
def test_one_percent_in_any_matrix_is_named_by_local_error(q8, ref_engine, tmp_path, matrix):
    ids = ref_engine.tokenizer.encode(PROMPTS[0])
    mutated = plant_scale(q8, tmp_path / "m.gguf", f"blk.1.{matrix}.weight", 1.01)
    sub = record_engine(llorch_ref.load(mutated, weights="eager"), ids, n_greedy=4)
    ref = record_engine(ref_engine, ids, n_greedy=4)
    band_class = engine_band_class(ref_engine)
    plain = compare_dumps(sub, ref, ref_engine.config, band_class)
    local = compare_dumps(sub, ref, ref_engine.config, band_class, local_engine=ref_engine)
    cp, tensor = EXPECT[matrix]
    assert where(local.first_divergence) == (cp, 1, tensor) and local.first_divergence["by"] == "local error"
    row = next(r for r in local.rows if r.layer == 1 and r.tensor == tensor)
    assert 1e-5 < row.local["nmse"] < 1e-3                 # about 0.01^2: the planted error, not noise
    # without the local figures, the wide end-to-end bands of quantized weights let it through
    assert where(plain.first_divergence) != (cp, 1, tensor)


def test_clean_model_raises_no_alarm(q8, ref_engine):
    other = llorch_ref.load(q8)                            # lazy weights: another path through the same math
    for p in PROMPTS:
        ids = ref_engine.tokenizer.encode(p)
        res = compare_dumps(record_engine(other, ids, n_greedy=4), record_engine(ref_engine, ids, n_greedy=4),
                            ref_engine.config, engine_band_class(ref_engine), local_engine=ref_engine)
        assert res.first_divergence is None, (p, res.first_divergence)
        assert sum(r.local is not None for r in res.rows) >= 3 * 15   # every layer tensor has its local figure


@pytest.mark.llamacpp
def test_llamacpp_subject_with_declared_ggml_arithmetic(q8, llamacpp, tmp_path):
    """llama.cpp's dump declares ggml arithmetic; the reference runs it, and a 1% error in ffn_down of layer 2
    is named at checkpoint 6, layer 2; the clean file passes on five prompts."""
    from llorch_ref.references.engines import dump_llamacpp

    eng = llorch_ref.load(q8, numerics="ggml")
    for p in PROMPTS:
        ids = eng.tokenizer.encode(p)
        sub = load_dump(dump_llamacpp(q8, token_ids=ids, n_greedy=4).save(tmp_path / "clean.safetensors"))
        assert sub.arithmetic["numerics"] == "ggml"
        res = compare_dumps(sub, record_engine(eng, ids, n_greedy=4), eng.config, engine_band_class(eng),
                            local_engine=eng)
        assert res.first_divergence is None, (p, res.first_divergence)
    mutated = plant_scale(q8, tmp_path / "m.gguf", "blk.2.ffn_down.weight", 1.01)
    ids = eng.tokenizer.encode(PROMPTS[0])
    sub = dump_llamacpp(mutated, token_ids=ids, n_greedy=4)
    res = compare_dumps(sub, record_engine(eng, ids, n_greedy=4), eng.config, engine_band_class(eng), local_engine=eng)
    assert where(res.first_divergence) == ("6", 2, "ffn_out")


@pytest.mark.llamacpp
def test_cli_dump_then_diff_names_the_planted_error(q8, llamacpp, tmp_path):
    import subprocess
    import sys

    mutated = plant_scale(q8, tmp_path / "m.gguf", "blk.1.ffn_up.weight", 1.01)
    run = lambda *a: subprocess.run([sys.executable, "-m", "llorch_ref.cli", *map(str, a)], capture_output=True,
                                    text=True, timeout=600)
    d = run("dump", "--engine", "llamacpp", "--model", mutated, "--out", tmp_path / "d.safetensors")
    assert d.returncode == 0, d.stderr
    r = run("diff", "--subject", tmp_path / "d.safetensors", "--model", q8)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "first divergence: checkpoint 6, layer 1, tensor ffn_swiglu (by local error)" in r.stdout, r.stdout
    assert "declares ggml arithmetic" in r.stderr


def test_format_1_dumps_still_read_and_declare_nothing(ref_engine, tmp_path):
    ids = ref_engine.tokenizer.encode(PROMPTS[0])
    rec = record_engine(ref_engine, ids, n_greedy=2)
    rec.extra.pop("arithmetic")
    man = rec.manifest()
    man["format"] = "llorch-dump/1"
    from llorch_ref.dump import Dump
    d = Dump(manifest=man, tensors=dict(rec.tensors), source="old")
    assert d.arithmetic is None
    res = compare_dumps(d, record_engine(ref_engine, ids, n_greedy=2), ref_engine.config, "F32",
                        local_engine=ref_engine)
    assert res.first_divergence is None


def test_earlier_short_kv_names_are_read_as_the_long_ones(ref_engine, tmp_path):
    """Dumps written before the one vocabulary declared K/V f32/f16: read as float32/float16, and the local
    bands of that declaration apply."""
    ids = ref_engine.tokenizer.encode(PROMPTS[0])
    rec = record_engine(ref_engine, ids, n_greedy=2)
    assert rec.extra["arithmetic"]["kv_dtype"] == "float32"
    rec.extra["arithmetic"]["kv_dtype"] = "f32"
    d = load_dump(rec.save(tmp_path / "old.safetensors"))
    assert d.arithmetic["kv_dtype"] == "float32"
    res = compare_dumps(d, record_engine(ref_engine, ids, n_greedy=2), ref_engine.config, "F32",
                        local_engine=ref_engine)
    assert res.local_declaration == "exact/float32" and res.first_divergence is None
