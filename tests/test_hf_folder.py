"""Hugging Face folders: GGUF -> HF conversion, the HF loader, and both paths giving the same numbers."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from test_cli import assert_one_line_error, run

import llorch_ref
from llorch_ref.convert import convert_gguf_to_hf
from llorch_ref.errors import LlorchError, ModelFileError, UnsupportedModelError
from llorch_ref.loaders.hf_folder import load_hf_folder, read_safetensors
from llorch_ref.loaders.qk_rows import permute_qk, unpermute_qk

TEXTS = ["Hello, world! It's 2026.", "  two  spaces\tand\nnewlines", "ünïcödé 日本語 🙂", "abc123 def"]


def nmse(a, b):
    return float(((a - b) ** 2).sum() / (a ** 2).sum())


@pytest.fixture(scope="module", params=[dict(vocab="bpe", tied=True), dict(vocab="spm", tied=False, n_kv_heads=4)],
                ids=["bpe-tied-gqa", "spm-untied-mha"])
def pair(request, tiny, tmp_path_factory):
    g = tiny(**request.param)
    d = tmp_path_factory.mktemp("hf") / "model"
    convert_gguf_to_hf(g, d)
    return g, d


def test_unpermute_moves_pair_members_to_the_two_halves():
    n_heads, hd, d = 2, 8, 3
    w = np.arange(n_heads * hd * d, dtype=np.float32).reshape(n_heads * hd, d)
    u = unpermute_qk(w, n_heads)
    for h in range(n_heads):
        for i in range(hd // 2):          # adjacent pair (2i, 2i+1) -> half-split pair (i, i + hd/2)
            assert (u[h * hd + i] == w[h * hd + 2 * i]).all()
            assert (u[h * hd + i + hd // 2] == w[h * hd + 2 * i + 1]).all()
    assert (permute_qk(u, n_heads) == w).all()


def test_hf_path_gives_bit_identical_logits_and_tokens(pair):
    g, d = pair
    eg, eh = llorch_ref.load(g), llorch_ref.load(d)
    assert eh.config.rope_style == "adjacent" and eh.config.extra["qk_rows_stored"] == "neox"
    ids = eg.tokenizer.encode("Once upon a time, there was")
    a, b = eg.logits(ids), eh.logits(ids)
    assert np.abs(a - b).max() == 0.0
    assert list(eg.generate_ids(ids, max_tokens=12, ignore_eos=True)) == \
        list(eh.generate_ids(ids, max_tokens=12, ignore_eos=True))


def test_hf_tokenizer_matches_gguf_tokenizer(pair):
    g, d = pair
    tg, th = llorch_ref.load(g).tokenizer, llorch_ref.load(d).tokenizer
    for s in TEXTS:
        assert th.encode(s) == tg.encode(s), s
        assert th.decode(tg.encode(s)) == tg.decode(tg.encode(s)), s
    assert (th.bos_id, th.eos_id, th.add_bos, th.eog_ids) == (tg.bos_id, tg.eos_id, tg.add_bos, tg.eog_ids)
    msgs = [{"role": "user", "content": "hi"}]
    assert th.chat_template == tg.chat_template
    if tg.chat_template:
        assert th.apply_chat_template(msgs) == tg.apply_chat_template(msgs)


def test_native_neox_layout_agrees_and_a_wrong_layout_is_caught(pair):
    g, d = pair
    eg = llorch_ref.load(g)
    ids = eg.tokenizer.encode("Once upon a time, there was")
    ref = eg.logits(ids)
    native = load_hf_folder(d, qk_layout="neox")
    assert native.config.rope_style == "neox"
    e = llorch_ref.engine.Engine(native.config, native.weights, native.tokenizer)
    assert nmse(ref, e.logits(ids)) < 1e-10
    # planted bug: half-split rows run with adjacent-pair RoPE (the permutation forgotten)
    import dataclasses
    bad = llorch_ref.engine.Engine(dataclasses.replace(native.config, rope_style="adjacent"), native.weights,
                                   native.tokenizer)
    assert nmse(ref, bad.logits(ids)) > 1e-6


def test_bf16_and_sharded_folders(pair, tmp_path):
    g, d = pair
    tensors = read_safetensors(d / "model.safetensors")
    names = sorted(tensors)
    out = tmp_path / "sharded"
    shutil.copytree(d, out)
    (out / "model.safetensors").unlink()
    from safetensors.numpy import save_file
    weight_map = {}
    for k, part in enumerate((names[: len(names) // 2], names[len(names) // 2:])):
        fname = f"model-0000{k + 1}-of-00002.safetensors"
        # bf16 = the top 16 bits of the float32; stored as uint16 then relabelled in the header below
        save_file({n: (tensors[n][1].view(np.uint32) >> 16).astype(np.uint16) for n in part}, str(out / fname))
        raw = bytearray((out / fname).read_bytes())
        n = int.from_bytes(raw[:8], "little")
        header = raw[8:8 + n].replace(b'"U16"', b'"BF16"')
        (out / fname).write_bytes(len(header).to_bytes(8, "little") + header + bytes(raw[8 + n:]))
        weight_map.update({nm: fname for nm in part})
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    h = load_hf_folder(out)
    assert set(h.tensor_types.values()) == {"BF16"}
    want = tensors["model.embed_tokens.weight"][1]
    got = h.weights.tok_embd
    assert np.abs(got - want).max() <= np.abs(want).max() * 2 ** -7      # bf16 keeps 8 mantissa bits
    assert (got.view(np.uint32) & 0xFFFF == 0).all()
    eg = llorch_ref.load(g)
    ids = eg.tokenizer.encode("Once upon a time")
    assert nmse(eg.logits(ids), llorch_ref.load(out).logits(ids)) < 1e-3


@pytest.mark.parametrize("edit,err,fragment", [
    (lambda d: (d / "config.json").unlink(), ModelFileError, "config.json: missing"),
    (lambda d: _patch(d, model_type="gemma3"), UnsupportedModelError, "model_type 'gemma3'"),
    (lambda d: _patch(d, rope_scaling={"rope_type": "proportional"}), UnsupportedModelError, "rope scaling"),
    (lambda d: _patch(d, rope_scaling={"rope_type": "llama3", "factor": 8.0}), ModelFileError, "lacks"),
    (lambda d: _patch(d, attention_bias=True), UnsupportedModelError, "attention_bias"),
    (lambda d: _patch(d, hidden_size=32), ModelFileError, "expected"),
    (lambda d: (d / "model.safetensors").write_bytes(b"\x10\x00"), ModelFileError, "truncated"),
    (lambda d: (d / "tokenizer.json").unlink(), LlorchError, "tokenizer.json: missing"),
])
def test_bad_folders_give_one_clear_error(pair, tmp_path, edit, err, fragment):
    _, d = pair
    bad = tmp_path / "bad"
    shutil.copytree(d, bad)
    edit(bad)
    with pytest.raises(err, match=fragment.replace("(", r"\(")):
        llorch_ref.load(bad)
    r = run("generate", "hi", "--model", bad, "--max-tokens", "1")
    assert_one_line_error(r, fragment)


def _patch(d, **kv):
    c = json.loads((d / "config.json").read_text())
    c.update(kv)
    (d / "config.json").write_text(json.dumps(c))


def test_cli_convert_to_hf_then_generate(tiny, tmp_path):
    g = tiny(vocab="bpe")
    out = tmp_path / "hf"
    r = run("convert", "--to", "hf", g, out)
    assert r.returncode == 0, r.stderr
    assert {p.name for p in out.iterdir()} >= {"config.json", "model.safetensors", "tokenizer.json",
                                              "tokenizer_config.json", "generation_config.json"}
    a = run("generate", "Once upon", "--model", g, "--max-tokens", "6", "--ignore-eos")
    b = run("generate", "Once upon", "--model", out, "--max-tokens", "6", "--ignore-eos")
    assert a.returncode == b.returncode == 0, b.stderr
    assert a.stdout == b.stdout
    again = run("convert", "--to", "hf", g, out)
    assert_one_line_error(again, "already exists")


def test_transformers_loads_the_converted_folder(pair):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    g, d = pair
    model = transformers.AutoModelForCausalLM.from_pretrained(str(d), torch_dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    eg = llorch_ref.load(g)
    ids = eg.tokenizer.encode("Once upon a time, there was")
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].numpy()
    ours = eg.logits(ids)
    assert np.abs(ref - ours).max() <= 1e-5 * max(1.0, np.abs(ref).max())
    assert nmse(ref, ours) < 1e-10


def test_diff_on_a_folder_needs_a_gguf_reference(pair, llamacpp):
    g, d = pair
    assert_one_line_error(run("diff", "--model", d, "--checkpoint", "8"), "llama.cpp reads GGUF files")
    r = run("diff", "--model", d, "--reference-model", g, "--checkpoint", "8")
    assert r.returncode == 0, r.stderr
    assert "first divergence: none" in r.stdout


@pytest.mark.llamacpp
@pytest.mark.parametrize("dtype, gguf_type", [("float32", "F32"), ("float16", "F16")])
def test_hf_folder_back_to_gguf_round_trip(llamacpp, pair, tmp_path, dtype, gguf_type):
    """GGUF -> HF -> GGUF: llama.cpp tokenizes alike and (f32) computes the same logits bit for bit."""
    import gguf

    from llorch_ref.convert import convert_hf_to_gguf
    from llorch_ref.references.llamacpp import LlamaCpp, tokenize
    g, d = pair
    out = convert_hf_to_gguf(d, tmp_path / f"back.{dtype}.gguf", dtype=dtype)
    r0, r1 = gguf.GGUFReader(str(g)), gguf.GGUFReader(str(out))
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.pre", "llama.attention.head_count_kv",
                "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id"):
        if key in r0.fields:
            assert r1.fields[key].contents() == r0.fields[key].contents(), key
    types = {t.name: t.tensor_type.name for t in r1.tensors}
    assert types["blk.0.attn_q.weight"] == gguf_type and types["blk.0.attn_norm.weight"] == "F32"
    for t in TEXTS:
        assert tokenize(out, t) == tokenize(g, t), t
    ids = tokenize(g, "Once upon a time, there was")
    a, b = LlamaCpp(g, n_ctx=64), LlamaCpp(out, n_ctx=64)
    try:
        la, lb = a.eval(ids), b.eval(ids)
    finally:
        a.close(), b.close()
    if dtype == "float32":
        assert np.array_equal(la, lb)                 # same weights, same Q/K permutation, same graph
    else:
        assert 0 < nmse(la, lb) < 1e-4


def test_cli_convert_folder_to_gguf(pair, tmp_path):
    g, d = pair
    r = run("convert", str(d), str(tmp_path / "o.gguf"))
    assert r.returncode == 0, r.stderr
    assert llorch_ref.load(tmp_path / "o.gguf").config == llorch_ref.load(g).config
    r = run("convert", "--to", "hf", str(d), str(tmp_path / "x"))
    assert_one_line_error(r, "converts --to gguf")
