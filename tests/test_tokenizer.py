"""Tokenizer: ids equal llama.cpp's llama_tokenize(add_special=True, parse_special=True); decode inverts."""
from __future__ import annotations

import pytest

import llorch_ref
from llorch_ref.errors import TokenizerError

TRICKY = [
    "Once upon a time, there was a little",
    "12345678901234567890 3.14159 1,000,000 0.5e-10 2024-11-26 007",
    "  leading and   internal   spaces",
    "trailing spaces   ",
    "\n\nnewlines\n\n\nand\ttabs\t\t and \r\n windows",
    "I'm you're we'll they've she'd it's don't CAN'T I'M",
    "héllo wörld naïve café façade Æsir ß",
    "emoji 🤖👍🏽🎉 family 👨‍👩‍👧 flags 🇫🇷",
    "日本語のテキスト 中文字符 한국어 텍스트 ไทย العربية עברית",
    "def f(x):\n    return {'a': [1, 2, 3]}  # comment\n\nif x != y && z <= 3: pass",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><|endoftext|>text after eot",
    "not special: <|im_start and im_end|>",
    "$$$ ### @@@ !!! ??? ... --- ___ ~~~",
    "a",
    " ",
    "\u200b zero width \u00a0 nbsp",
    "Ünïcödé ĳ ǅ ﬁ ①②③ ½",
]


@pytest.fixture(scope="module")
def llama_tokenize(llamacpp):
    from llorch_ref.references.llamacpp import tokenize
    return tokenize


def test_default_model_corpus_matches_llamacpp(default_model, engine_q41, llama_tokenize):
    tok = engine_q41.tokenizer
    mismatches = [(s, tok.encode(s), llama_tokenize(default_model, s)) for s in TRICKY
                  if tok.encode(s) != llama_tokenize(default_model, s)]
    agreement = 1 - len(mismatches) / len(TRICKY)
    print(f"tokenizer agreement with llama.cpp on {len(TRICKY)} strings: {agreement:.1%}")
    assert mismatches == []


@pytest.mark.parametrize("kw", [
    dict(vocab="bpe", pre="smollm"), dict(vocab="bpe", pre="llama-bpe"), dict(vocab="bpe", pre="gpt-2"),
    dict(vocab="bpe", pre="default"), dict(vocab="bpe", pre="qwen2"), dict(vocab="spm"),
    dict(vocab="bpe", pre="smollm", add_bos=True),
], ids=lambda kw: "-".join(str(v) for v in kw.values()))
def test_tiny_vocabularies_match_llamacpp(tiny, llama_tokenize, kw):
    path = tiny(**kw)
    tok = llorch_ref.load(path).tokenizer
    for s in TRICKY:
        assert tok.encode(s) == llama_tokenize(path, s), s


@pytest.mark.parametrize("kw", [dict(vocab="bpe"), dict(vocab="spm")], ids=["bpe", "spm"])
def test_decode_inverts_encode(tiny, kw):
    tok = llorch_ref.load(tiny(**kw)).tokenizer
    for s in TRICKY:
        assert tok.decode(tok.encode(s)) == s


def test_stream_decoder_emits_split_characters_whole(engine_q41):
    tok = engine_q41.tokenizer
    text = "🤖 ok 日本"
    ids = tok.encode(text)
    dec = tok.stream_decoder()
    pieces = [dec.push(i) for i in ids] + [dec.flush()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    # at least one character spans several tokens, and it came out in one piece
    assert any(len(tok.token_bytes(i).decode("utf-8", errors="ignore")) == 0 for i in ids)
    assert "🤖" in pieces or any(p.startswith("🤖") or p.endswith("🤖") for p in pieces)


def test_special_tokens_and_eog(engine_q41):
    tok = engine_q41.tokenizer
    assert tok.encode("<|im_end|>") == [2]
    assert {0, 2} <= tok.eog_ids                 # <|endoftext|> and <|im_end|> both end generation
    assert tok.add_bos is False                  # from tokenizer.ggml.add_bos_token


def test_chat_template(engine_q41):
    text = engine_q41.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert text.endswith("<|im_start|>assistant\n")
    assert "<|im_start|>user\nHi<|im_end|>" in text


def test_unimplemented_pre_tokenizer_is_refused():
    from llorch_ref.tokenizer import from_gguf_metadata

    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "deepseek-llm",
            "tokenizer.ggml.tokens": ["a", "b"], "tokenizer.ggml.merges": []}
    with pytest.raises(TokenizerError, match="deepseek-llm"):
        from_gguf_metadata(meta)
