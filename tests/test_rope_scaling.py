"""RoPE scaling: linear (GGUF rope.scaling.type) and per-pair frequency factors (GGUF rope_freqs.weight, the
form llama.cpp gives Llama 3's scaling; Hugging Face rope_scaling 'llama3'); YaRN (attention factor, mscale),
LongRoPE (short and long factor sets, chosen by the sequence's length) and dynamic NTK from config.json against
transformers past the original context; YaRN and LongRoPE from GGUF against llama.cpp. Planted bugs: a missing
YaRN mscale, LongRoPE's set chosen by the allocated context, dynamic NTK's base not grown."""
from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
from llorch_test_helpers import tiny_hf_gguf

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
    """GGUF has no dynamic NTK (llama.cpp has none); keys llama.cpp reads for other architectures only, and
    LongRoPE tensors outside phi3, are refused by name."""
    from llorch_ref.testing.tiny import write_tiny_model
    p = write_tiny_model(tmp_path / "t.gguf", vocab="none")
    with pytest.raises(UnsupportedModelError, match="RoPE scaling 'dynamic' is not implemented"):
        llorch_ref.load(_regguf(p, tmp_path / "d.gguf", kv=_gguf_kv(type="dynamic")))
    with pytest.raises(UnsupportedModelError, match="yarn_log_multiplier is not implemented"):
        llorch_ref.load(_regguf(p, tmp_path / "y.gguf", kv=_gguf_kv(type="yarn", yarn_log_multiplier=0.1)))
    with pytest.raises(UnsupportedModelError, match="for phi3 alone"):
        llorch_ref.load(_regguf(p, tmp_path / "l.gguf", tensors=[("rope_factors_short.weight", np.ones(8)),
                                                                 ("rope_factors_long.weight", np.ones(8))]))


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
         "num_attention_heads": 2, "intermediate_size": 16, "rope_scaling": {"rope_type": "proportional"}}
    with pytest.raises(UnsupportedModelError, match="rope scaling 'proportional'"):
        config_from_hf(c, tmp_path)
    c["rope_scaling"] = {"rope_type": "linear", "factor": 2.0}
    assert config_from_hf(c, tmp_path).rope_freq_scale == 0.5
    json.dumps(c)


@pytest.mark.parametrize("rs, match", [
    ({"rope_type": "dynamic"}, "dynamic rope scaling lacks a numeric 'factor'"),
    ({"rope_type": "dynamic", "factor": 0.5}, "rope_ntk_factor=0.5 must be 0 .off. or >= 1"),
    ({"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0, 2.0]}, "short_factor as a list of 2"),
    ({"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 1}, "must be > 1"),
    ({"rope_type": "yarn", "factor": -2.0}, "factor=-2.0 must be > 0")])
def test_hf_bad_rope_scaling_gives_one_clear_error(tmp_path, rs, match):
    from llorch_ref.errors import LlorchError
    from llorch_ref.loaders.hf_folder import config_from_hf
    c = {"model_type": "llama", "vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 1,
         "num_attention_heads": 2, "intermediate_size": 16, "rope_scaling": rs}
    with pytest.raises(LlorchError, match=match) as e:
        config_from_hf(c, tmp_path)
    assert "\n" not in str(e.value)


# -- YaRN, LongRoPE and dynamic NTK against transformers, at positions past the original context --------------

def _tiny_hf(tmp_path, kind, **kw):
    """A seeded tiny random transformers model (llama, qwen2 or phi3) saved with a tokenizer -> (folder, model)."""
    torch = pytest.importorskip("torch", reason="torch is not installed (pip install -e '.[hf]')")
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    from tokenizers import Tokenizer, models

    from llorch_ref.testing.tiny import bpe_vocab
    torch.manual_seed(0)
    conf, model_cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
                       "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
                       "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM)}[kind]
    args = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=128, rope_theta=10000.0, tie_word_embeddings=False)
    if kind == "phi3":
        args.update(sliding_window=None, pad_token_id=None)
    model = model_cls(conf(**{**args, **kw})).eval()
    folder = tmp_path / kind
    model.save_pretrained(str(folder), safe_serialization=True)
    toks, _, _ = bpe_vocab()
    Tokenizer(models.BPE({t: i for i, t in enumerate(toks[:97])}, [])).save(str(folder / "tokenizer.json"))
    return folder, model


def _ids(n):
    return [(7 * i + 5) % 97 for i in range(n)]


def _first_divergence(eng, folder, ids):
    """Every checkpoint of eng against transformers on ids -> the first divergence (None: all passed)."""
    from llorch_ref.harness.compare import compare_dumps
    from llorch_ref.references.engines import dump_transformers
    from llorch_ref.references.llorch import record_engine
    res = compare_dumps(record_engine(eng, ids, n_greedy=0), dump_transformers(folder, token_ids=ids, n_greedy=0),
                        eng.config, "F32")
    return res.first_divergence


def _logits_nmse(eng, model, ids):
    import torch
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0].numpy()
    return compare(eng.logits(ids), want)["nmse"]


YARN = {"qwen2.5": ("qwen2", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}),
        "deepseek": ("llama", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                               "mscale": 1.0, "mscale_all_dim": 0.5, "beta_fast": 16, "beta_slow": 2}),
        "attention_factor": ("llama", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                                       "attention_factor": 0.8, "truncate": False})}


@pytest.mark.parametrize("style", sorted(YARN))
def test_hf_yarn_matches_transformers_and_a_missing_mscale_is_caught(tmp_path, style):
    kind, rs = YARN[style]
    folder, model = _tiny_hf(tmp_path, kind, rope_scaling=dict(rs, rope_theta=10000.0))
    eng = llorch_ref.load(folder)
    assert eng.config.rope_attn_factor != 1.0 and eng.config.rope_yarn_ramp is not None
    ids = _ids(100)                                     # positions 0..99, the original context is 32
    assert _logits_nmse(eng, model, ids) < 1e-10
    assert _first_divergence(eng, folder, ids) is None
    eng.config = dataclasses.replace(eng.config, rope_attn_factor=1.0)                    # planted: mscale missing
    fd = _first_divergence(eng, folder, ids)
    assert fd is not None and (fd["checkpoint"], fd["layer"], fd["tensor"]) == ("1B", 0, "q")


def _phi3_longrope(tmp_path):
    rng = np.random.default_rng(5)
    short = [float(x) for x in rng.uniform(1.0, 1.2, 8)]
    long = [float(x) for x in rng.uniform(1.0, 16.0, 8)]
    return _tiny_hf(tmp_path, "phi3", original_max_position_embeddings=32,
                    rope_scaling={"rope_type": "longrope", "short_factor": short, "long_factor": long,
                                  "rope_theta": 10000.0})


@pytest.mark.parametrize("n", [20, 100], ids=["short", "long"])
def test_hf_longrope_picks_the_factor_set_by_sequence_length(tmp_path, n):
    """Phi-3's LongRoPE: the short factors for a sequence within the original 32 positions, the long ones past
    it, whatever the allocated context (128 here), as transformers picks them on each forward call."""
    folder, model = _phi3_longrope(tmp_path)
    eng = llorch_ref.load(folder)
    c = eng.config
    assert c.rope_orig_ctx == 32 and c.rope_freq_factors_long is not None and eng.n_ctx > 32
    assert c.rope_attn_factor == pytest.approx((1 + math.log(128 / 32) / math.log(32)) ** 0.5)
    ids = _ids(n)
    assert _logits_nmse(eng, model, ids) < 1e-10
    assert _first_divergence(eng, folder, ids) is None


def test_hf_longrope_chosen_by_the_allocated_context_is_caught(tmp_path, monkeypatch):
    """Planted bug (llama.cpp's, ggml-org/llama.cpp#24823): the factor set chosen by n_ctx (128, past the
    original 32) instead of the sequence's length: a 20-token sequence then takes the long factors."""
    from llorch_ref.model.cache import Cache
    folder, model = _phi3_longrope(tmp_path)
    eng = llorch_ref.load(folder)
    monkeypatch.setattr(Cache, "rope_seq_len", lambda self, n_new: self.n_ctx)
    ids = _ids(20)
    assert _logits_nmse(eng, model, ids) > 1e-6
    fd = _first_divergence(eng, folder, ids)
    assert fd is not None and (fd["checkpoint"], fd["layer"], fd["tensor"]) == ("1B", 0, "q")


def _roped_q0(torch, model, ids):
    """transformers' layer-0 Q after RoPE on ids, [T, H, Hd] (NeoX pairs), and the logits."""
    from llorch_ref.references.engines import _rope_outputs
    with torch.no_grad(), _rope_outputs(model) as roped:
        logits = model(torch.tensor([ids])).logits[0].numpy()
    return roped[0][0][0].transpose(0, 1).numpy(), logits


def test_hf_dynamic_ntk_matches_transformers_past_its_context(tmp_path):
    """Dynamic NTK: the base grows with the sequence past max_position_embeddings (32 here), recomputed by
    transformers on every forward call; dump_transformers stops at max_position_embeddings, so the RoPE
    checkpoint (layer 0 Q) and the logits are compared here directly."""
    import torch

    from llorch_ref.engine import Engine
    from llorch_ref.loaders.hf_folder import load_hf_folder
    folder, model = _tiny_hf(tmp_path, "llama", max_position_embeddings=32,
                             rope_scaling={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    m = load_hf_folder(folder, qk_layout="neox")                      # Q rows as transformers holds them
    assert m.config.rope_ntk_factor == 2.0 and m.config.rope_orig_ctx == 32 and m.config.context_length == 64
    eng = Engine(m.config, m.weights, None)
    for n in (20, 60):                                              # within and past the 32 positions
        ids = _ids(n)
        want_q, want = _roped_q0(torch, model, ids)
        got_q, got = _q0_and_logits(eng, ids)
        assert compare(got_q, want_q)["nmse"] < 1e-12, n
        assert compare(got, want)["nmse"] < 1e-10, n
    eng.config = dataclasses.replace(eng.config, rope_ntk_factor=0.0, rope_orig_ctx=0)        # planted: no growth
    assert compare(_q0_and_logits(eng, ids)[0], want_q)["nmse"] > 1e-6


def _q0_and_logits(eng, ids):
    """The reference's layer-0 Q after RoPE on ids, and the logits."""
    got = {}
    logits = eng.logits(ids, record=lambda name, layer, a: got.setdefault((name, layer), a))
    return got[("q", 0)], logits


# -- GGUF: YaRN and LongRoPE as llama.cpp reads them, against llama.cpp -----------------------------------------

def _regguf(src, dst, kv=(), tensors=()):
    """A copy of the GGUF file src with the metadata kv ((key, value, GGUFValueType)) and the float32 tensors
    tensors ((name, array)) added -> dst."""
    import gguf
    r = gguf.GGUFReader(str(src))
    arch = r.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(str(dst), arch)
    for k, f in r.fields.items():
        if k.startswith("GGUF.") or k == "general.architecture":
            continue
        w.add_key_value(k, f.contents(), f.types[0], f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None)
    for k, v, t in kv:
        w.add_key_value(k.format(a=arch), v, t)
    for t in r.tensors:
        w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    for name, arr in tensors:
        w.add_tensor(name, np.asarray(arr, dtype=np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    return dst


def _llamacpp_divergence(path, ids, n_ctx, config=None):
    """The reference on path (its config replaced by `config` where given) against llama.cpp with an allocated
    context of n_ctx, every checkpoint -> (first divergence or None, logits NMSE)."""
    from llorch_ref.harness.compare import compare_dumps
    from llorch_ref.references.engines import dump_llamacpp
    from llorch_ref.references.llamacpp import LlamaCpp
    from llorch_ref.references.llorch import record_engine
    eng = llorch_ref.load(path)
    if config is not None:
        eng.config = config(eng.config)
    ref = LlamaCpp(path, n_ctx=n_ctx)
    try:
        want = dump_llamacpp(path, token_ids=ids, n_greedy=0, context=ref)
        logits = ref.eval(ids)
    finally:
        ref.close()
    res = compare_dumps(record_engine(eng, ids, n_greedy=0), want, eng.config, "F32")
    return res.first_divergence, compare(eng.logits(ids), logits)["nmse"]


def _gguf_kv(**kv):
    import gguf
    t = {str: gguf.GGUFValueType.STRING, float: gguf.GGUFValueType.FLOAT32, int: gguf.GGUFValueType.UINT32}
    return [("{a}.rope.scaling." + k, v, t[type(v)]) for k, v in kv.items()]


LONG_IDS = [3 + i % 50 for i in range(100)]


@pytest.mark.llamacpp
def test_gguf_yarn_matches_llamacpp_and_a_missing_mscale_is_caught(llamacpp, tiny, tmp_path):
    """YaRN as llama.cpp reads it from {arch}.rope.scaling.* (type, factor, original_context_length,
    attn_factor), 100 positions over an original context of 64: every checkpoint, and the logits; with
    numerics "ggml" the logits are bit-equal."""
    p = _regguf(tiny(), tmp_path / "yarn.gguf",
                kv=_gguf_kv(type="yarn", factor=4.0, original_context_length=64, attn_factor=0.9))
    c = llorch_ref.load(p).config
    assert c.rope_attn_factor == pytest.approx(float(np.float32(0.9)) * (1 + 0.1 * math.log(4.0)))
    assert len(set(c.rope_yarn_ramp)) > 2 and c.rope_freq_scale == 0.25  # kept, ramped, interpolated pairs
    fd, nmse = _llamacpp_divergence(p, LONG_IDS, 128)
    assert fd is None and nmse < 1e-10
    from llorch_ref.references.llamacpp import LlamaCpp
    ref = LlamaCpp(p, n_ctx=128)
    try:
        want = ref.eval(LONG_IDS)
    finally:
        ref.close()
    np.testing.assert_array_equal(llorch_ref.load(p, numerics="ggml").logits(LONG_IDS), want)   # ggml's rope_yarn
    fd, nmse = _llamacpp_divergence(p, LONG_IDS, 128,                 # planted: YaRN's mscale missing
                                    lambda c: dataclasses.replace(c, rope_attn_factor=float(np.float32(0.9))))
    assert (fd["checkpoint"], fd["layer"], fd["tensor"]) == ("1B", 0, "q") and nmse > 1e-3


@pytest.fixture(scope="module")
def phi3_gguf(tmp_path_factory):
    return tiny_hf_gguf(tmp_path_factory.mktemp("phi3"), "phi3")[1]


def _longrope_gguf(src, dst, orig):
    rng = np.random.default_rng(5)
    return _regguf(src, dst, kv=_gguf_kv(original_context_length=orig, attn_factor=1.15),
                   tensors=[("rope_factors_short.weight", rng.uniform(1.0, 1.2, 8)),
                            ("rope_factors_long.weight", rng.uniform(1.0, 16.0, 8))])


@pytest.mark.llamacpp
def test_gguf_longrope_matches_llamacpp_where_both_pick_one_set(llamacpp, phi3_gguf, tmp_path):
    """Phi-3's LongRoPE tensors (rope_factors_short/long.weight): llama.cpp picks the set by its allocated
    context per sequence, padded to 256, the reference by the sequence's length. They agree where both pick
    the short set (20 tokens, original context 300, n_ctx 256) and where both pick the long one (100 tokens,
    original context 32)."""
    p = _longrope_gguf(phi3_gguf, tmp_path / "short.gguf", 300)
    c = llorch_ref.load(p).config
    assert c.rope_orig_ctx == 300 and c.rope_freq_factors_long is not None
    assert c.rope_attn_factor == pytest.approx(1.15, rel=1e-7)
    assert _llamacpp_divergence(p, LONG_IDS[:20], 256)[0] is None
    p = _longrope_gguf(phi3_gguf, tmp_path / "long.gguf", 32)
    fd, nmse = _llamacpp_divergence(p, LONG_IDS, 128)
    assert fd is None and nmse < 1e-10
    fd, _ = _llamacpp_divergence(p, LONG_IDS, 128,                     # planted: LongRoPE's magnitude dropped
                                 lambda c: dataclasses.replace(c, rope_attn_factor=1.0))
    assert (fd["checkpoint"], fd["layer"], fd["tensor"]) == ("1B", 0, "q")


@pytest.mark.llamacpp
def test_llamacpp_picks_longrope_factors_by_its_allocated_context(llamacpp, phi3_gguf, tmp_path):
    """ggml-org/llama.cpp#24823 on the installed llama.cpp: a 20-token sequence with n_ctx 512 (past the
    original 300) is rotated with the long factors; the reference (and transformers) use the short ones, so
    the comparison fails at the RoPE checkpoint."""
    p = _longrope_gguf(phi3_gguf, tmp_path / "lr.gguf", 300)
    fd, nmse = _llamacpp_divergence(p, LONG_IDS[:20], 512)
    assert (fd["checkpoint"], fd["layer"], fd["tensor"]) == ("1B", 0, "q") and nmse > 1e-6


def test_hf_longrope_decode_steps_switch_sets_where_transformers_does(tmp_path, monkeypatch):
    """Decode steps crossing the original 32 positions (a 28-token prompt, 8 teacher-forced steps): each step
    takes the set of the length it ends at, keys already cached keep theirs, as transformers' forward calls
    on its cache do; every checkpoint of every step compared."""
    from llorch_ref.harness.compare import compare_dumps
    from llorch_ref.model.cache import Cache
    from llorch_ref.references.engines import dump_transformers
    from llorch_ref.references.llorch import record_engine
    folder, _ = _phi3_longrope(tmp_path)
    eng = llorch_ref.load(folder)
    ids, steps = _ids(28), _ids(36)[28:]
    want = dump_transformers(folder, token_ids=ids, n_greedy=0, decode_ids=steps)
    res = compare_dumps(record_engine(eng, ids, n_greedy=0, decode_ids=steps), want, eng.config, "F32")
    assert res.first_divergence is None
    assert {r.step for r in res.rows if r.checkpoint == "1B"} == set(range(9))
    # planted: the set fixed by the prompt's length for the whole sequence (steps 5..8 end past 32 positions)
    monkeypatch.setattr(Cache, "rope_seq_len", lambda self, n_new: min(self.pos + n_new, 28))
    fd = compare_dumps(record_engine(eng, ids, n_greedy=0, decode_ids=steps), want, eng.config, "F32").first_divergence
    assert fd is not None and (fd["checkpoint"], fd["step"]) == ("1B", 5)


@pytest.mark.parametrize("n", [20, 100], ids=["short", "long"])
def test_hf_longrope_dump_is_checked_locally_with_its_own_factor_set(tmp_path, n):
    """diff --subject on transformers' dump of a LongRoPE model: the teacher-forced (local) RoPE of each row
    takes the factor set of the step's own sequence length, so a clean dump past the original context (100 of
    32 positions: the long set) passes, as one within it does; a dump whose Q was roped with the other set fails
    at layer 0's q."""
    from llorch_ref.harness.run import check_dump
    from llorch_ref.references.engines import dump_transformers
    folder, _ = _phi3_longrope(tmp_path)
    ids = _ids(n)
    path = dump_transformers(folder, token_ids=ids, n_greedy=0).save(tmp_path / "dump.safetensors")
    res = check_dump(path, model=folder)
    v = res.verdict()           # INCOMPLETE only for cp0: a dump of token ids without their prompt text
    assert v.diverging == 0 and res.first_divergence is None and v.compared > 30, v
    from llorch_ref.model.cache import Cache
    real = Cache.rope_seq_len
    with pytest.MonkeyPatch.context() as mp:       # planted in the subject: the other set for its whole run
        mp.setattr(Cache, "rope_seq_len", lambda self, n_new: 1 if n > 32 else 10 ** 6)
        from llorch_ref.references.llorch import record_engine
        bad = record_engine(llorch_ref.load(folder), ids, n_greedy=0).save(tmp_path / "bad.safetensors")
    assert Cache.rope_seq_len is real
    fd = check_dump(bad, model=folder).first_divergence
    assert fd is not None and (fd["checkpoint"], fd["layer"], fd["tensor"]) == ("1B", 0, "q"), fd
