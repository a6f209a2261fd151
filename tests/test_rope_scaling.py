"""RoPE scaling: linear (GGUF rope.scaling.type) and per-pair frequency factors (GGUF rope_freqs.weight, the
form llama.cpp gives Llama 3's scaling; Hugging Face rope_scaling 'llama3')."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

import llorch_ref
from llorch_ref.errors import UnsupportedModelError
from llorch_ref.harness.metrics import compare

IDS = list(range(3, 60))            # long enough for low-frequency pairs to turn


@pytest.mark.llamacpp
@pytest.mark.parametrize("scaling", [("linear", 4.0), ("freqs", 3)], ids=["linear", "freqs"])
def test_scaled_rope_matches_llamacpp_and_dropping_it_is_caught(llamacpp, tiny, scaling):
    from llorch_ref.references.llamacpp import LlamaCpp
    p = tiny(rope_scaling=scaling)
    eng = llorch_ref.load(p)
    assert (eng.config.rope_freq_scale != 1.0) or (eng.config.rope_freq_factors is not None)
    ref = LlamaCpp(p, n_ctx=128)
    try:
        want = ref.eval(IDS)
    finally:
        ref.close()
    assert compare(eng.logits(IDS), want)["nmse"] < 1e-10
    eng.config = dataclasses.replace(eng.config, rope_freq_scale=1.0, rope_freq_factors=None)   # planted bug
    assert compare(eng.logits(IDS), want)["nmse"] > 1e-3


def test_unknown_rope_scaling_is_rejected(tiny, tmp_path):
    import gguf

    from llorch_ref.testing.tiny import write_tiny_model
    p = write_tiny_model(tmp_path / "yarn.gguf", vocab="none")
    # rewrite with a YaRN scaling type: not implemented, so refused by name
    r = gguf.GGUFReader(str(p))
    w = gguf.GGUFWriter(str(tmp_path / "y2.gguf"), "llama")
    for k, f in r.fields.items():
        if k.startswith("GGUF.") or k == "general.architecture":
            continue
        w.add_key_value(k, f.contents(), f.types[0], f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None)
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    for t in r.tensors:
        w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    with pytest.raises(UnsupportedModelError, match="RoPE scaling 'yarn' is not implemented"):
        llorch_ref.load(tmp_path / "y2.gguf")


def test_hf_llama3_rope_scaling_matches_transformers(tmp_path):
    torch = pytest.importorskip("torch", reason="torch is not installed (pip install -e '.[hf]')")
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    from llorch_ref.engine import Engine
    from llorch_ref.loaders.hf_folder import load_hf_folder
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   rope_theta=10000.0, tie_word_embeddings=False,
                                   rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.save_pretrained(str(tmp_path / "m"), safe_serialization=True)
    from tokenizers import Tokenizer, models

    from llorch_ref.testing.tiny import bpe_vocab
    toks, _, merges = bpe_vocab()
    Tokenizer(models.BPE({t: i for i, t in enumerate(toks[:97])}, [])).save(str(tmp_path / "m" / "tokenizer.json"))
    m = load_hf_folder(tmp_path / "m")
    assert m.config.rope_freq_factors is not None and max(m.config.rope_freq_factors) == 8.0
    eng = Engine(m.config, m.weights, None)
    ids = [i % 97 for i in range(5, 130)]
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0].numpy()
    got = eng.logits(ids)
    assert compare(got, want)["nmse"] < 1e-10
    eng.config = dataclasses.replace(eng.config, rope_freq_factors=None)                          # planted bug
    assert compare(eng.logits(ids), want)["nmse"] > 1e-6       # 5 orders above the pass threshold


def test_hf_unknown_rope_scaling_is_rejected(tmp_path):
    from llorch_ref.loaders.hf_folder import config_from_hf
    c = {"model_type": "llama", "vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 1,
         "num_attention_heads": 2, "intermediate_size": 16, "rope_scaling": {"rope_type": "yarn", "factor": 2.0}}
    with pytest.raises(UnsupportedModelError, match="rope scaling 'yarn'"):
        config_from_hf(c, tmp_path)
    c["rope_scaling"] = {"rope_type": "linear", "factor": 2.0}
    assert config_from_hf(c, tmp_path).rope_freq_scale == 0.5
    json.dumps(c)
