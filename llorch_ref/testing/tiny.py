"""Tiny random Llama models, written with gguf.GGUFWriter, deterministic for a given seed.

Vocabularies are trained here with the `tokenizers` library on a fixed corpus (byte-level BPE for
`gpt2` vocabularies, score-ranked pieces with byte fallback for SentencePiece-style `llama` ones), or
left out (`no_vocab`, token ids only), so tests need no download.
"""
from __future__ import annotations

import json
import zlib
from pathlib import Path

import gguf
import numpy as np

from .blocks import random_blocks

CORPUS = """Once upon a time, there was a little girl named Lily. She loved to play outside in the sun.
The quick brown fox jumps over the lazy dog. I'm sure they'll say it's fine; we've done it before.
def add(a, b):\n    return a + b\n\nfor i in range(10):\n    print(i * 2)
In 1969, 3 astronauts flew 384,400 km. Prices: $12.50, 99% off! Call 555-0123 now.
Héllo wörld, naïve café. 日本語のテキスト. 中文. 한국어. Emoji: 🤖👍🏽🎉
The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is Rome.
"""
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
                 "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
                 "{% endif %}")


def bpe_vocab(n_merges=300):
    """-> tokens, token_types, merges of a byte-level BPE vocabulary (specials first, ids 0..2)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=len(SPECIALS) + len(alphabet) + n_merges, special_tokens=SPECIALS,
                                  initial_alphabet=alphabet, show_progress=False, min_frequency=1)
    tok.train_from_iterator([CORPUS] * 3, trainer=trainer)
    model = json.loads(tok.to_str())["model"]
    vocab = sorted(model["vocab"].items(), key=lambda kv: kv[1])
    tokens = [t for t, _ in vocab]
    types = [3 if t in SPECIALS else 1 for t in tokens]
    merges = [" ".join(m) if isinstance(m, list) else m for m in model["merges"]]
    return tokens, types, merges


def spm_vocab(n_pieces=300):
    """-> tokens, token_types, scores of a SentencePiece-style vocabulary: <unk> <s> </s>, 256 byte tokens,
    then pieces ('▁' for space) with scores decreasing in training order."""
    from tokenizers import Tokenizer, models, normalizers, trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    trainer = trainers.BpeTrainer(vocab_size=n_pieces, show_progress=False, min_frequency=1)
    tok.train_from_iterator([CORPUS.replace("\n", " ")] * 3, trainer=trainer)
    pieces = [t for t, _ in sorted(tok.get_vocab().items(), key=lambda kv: kv[1])]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    scores = [0.0, 0.0, 0.0] + [0.0] * 256
    for i, p in enumerate(pieces):
        if p in tokens:
            continue
        tokens.append(p)
        types.append(1)
        scores.append(-float(i))
    return tokens, types, scores


def _rand(name, shape, seed, scale=0.02):
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def _tiny_vocab(w, vocab, pre, add_bos, tokens, types, merges, scores):
    """The tokenizer metadata of a tiny model: byte-level BPE (gpt2), SentencePiece-style (llama) or none."""
    if vocab == "none":
        w.add_tokenizer_model("no_vocab")
    elif vocab == "bpe":
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre)
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_add_bos_token(bool(add_bos) if add_bos is not None else False)
        w.add_chat_template(CHAT_TEMPLATE)
    else:
        w.add_tokenizer_model("llama")
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_scores(scores)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_unk_token_id(0)
        w.add_add_bos_token(True if add_bos is None else bool(add_bos))


def _tiny_weights(w, weight_type, seed, n_vocab, d_model, d_ff, n_layers, n_heads, n_kv_heads, tied, rope_scaling):
    """Deterministic random weights of a tiny model, quantized to weight_type (mixed: Q8_0 embeddings and FFN,
    F16 attention; mixed_qkv: Q8_0 embeddings and Q/K/O, Q4_0 V, Q4_1 FFN, so that Q, K and V are of two types, as
    in llama.cpp's Q4_K_M files; k_mixed: a Q4_K_M file's mix, Q4_K matrices but for Q6_K output, and Q6_K V and
    down in odd layers, Q8_0 embeddings: rows must be multiples of 256)."""
    head_dim = d_model // n_heads

    def put(name, arr, kind, layer=0):
        t = weight_type
        if weight_type == "k_mixed":
            t = {"embd": "Q8_0", "out": "Q6_K"}.get(kind, "Q6_K" if kind in ("v", "down") and layer % 2 else "Q4_K")
        elif weight_type == "mixed":
            t = {"embd": "Q8_0", "attn": "F16", "v": "F16", "ffn": "Q8_0", "down": "Q8_0", "out": "F32"}[kind]
        elif weight_type == "mixed_qkv":
            t = {"embd": "Q8_0", "attn": "Q8_0", "v": "Q4_0", "ffn": "Q4_1", "down": "Q4_1", "out": "F32"}[kind]
        if arr.ndim == 1 or t == "F32":
            w.add_tensor(name, arr)
        elif t == "F16":
            w.add_tensor(name, arr.astype(np.float16))
        elif t in ("Q4_K", "Q6_K"):             # gguf-py cannot quantize to K-quants: random blocks of arr's spread
            w.add_tensor(name, random_blocks(name, *arr.shape, t, float(arr.std()), seed),
                         raw_dtype=gguf.GGMLQuantizationType[t])
        else:
            qt = gguf.GGMLQuantizationType[t]
            w.add_tensor(name, gguf.quants.quantize(arr, qt), raw_dtype=qt)

    put("token_embd.weight", _rand("token_embd", (n_vocab, d_model), seed, 0.5), "embd")
    for i in range(n_layers):
        p = f"blk.{i}."
        put(p + "attn_norm.weight", 1.0 + _rand(p + "attn_norm", (d_model,), seed, 0.1), "attn")
        put(p + "attn_q.weight", _rand(p + "q", (n_heads * head_dim, d_model), seed, 0.2), "attn")
        put(p + "attn_k.weight", _rand(p + "k", (n_kv_heads * head_dim, d_model), seed, 0.2), "attn")
        put(p + "attn_v.weight", _rand(p + "v", (n_kv_heads * head_dim, d_model), seed, 0.2), "v", i)
        put(p + "attn_output.weight", _rand(p + "o", (d_model, n_heads * head_dim), seed, 0.1), "attn")
        put(p + "ffn_norm.weight", 1.0 + _rand(p + "ffn_norm", (d_model,), seed, 0.1), "ffn")
        put(p + "ffn_gate.weight", _rand(p + "gate", (d_ff, d_model), seed, 0.2), "ffn")
        put(p + "ffn_up.weight", _rand(p + "up", (d_ff, d_model), seed, 0.2), "ffn")
        put(p + "ffn_down.weight", _rand(p + "down", (d_model, d_ff), seed, 0.1), "down", i)
    put("output_norm.weight", 1.0 + _rand("output_norm", (d_model,), seed, 0.1), "out")
    if rope_scaling and rope_scaling[0] == "freqs":
        f = np.random.default_rng(rope_scaling[1]).uniform(1.0, 8.0, head_dim // 2).astype(np.float32)
        w.add_tensor("rope_freqs.weight", f)
    if not tied:
        put("output.weight", _rand("output", (n_vocab, d_model), seed, 0.2), "out")


def write_tiny_model(path, *, vocab="bpe", pre="smollm", d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                     d_ff=96, context_length=128, weight_type="F32", tied=False, seed=0, rms_eps=1e-5,
                     rope_base=10000.0, n_vocab_none=128, add_bos=None, rope_scaling=None,
                     extra_specials=()) -> Path:
    """Write a tiny random llama GGUF. vocab: 'bpe' | 'spm' | 'none';
    weight_type: F32 | F16 | Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q8_0 | mixed (Q8_0 embeddings and FFN, F16 attention) |
    mixed_qkv (Q8_0 embeddings and Q/K/O, Q4_0 V, Q4_1 FFN) | k_mixed (Q4_K and Q6_K as a Q4_K_M file mixes them;
    d_model and d_ff multiples of 256).
    rope_scaling: None, ("linear", factor) or ("freqs", seed): a rope_freqs.weight tensor of per-pair factors
    in [1, 8] (llama3-style scaling as llama.cpp stores it)."""
    path = Path(path)
    head_dim = d_model // n_heads
    tokens = types = merges = scores = None
    if vocab == "bpe":
        tokens, types, merges = bpe_vocab()
        tokens, types = tokens + list(extra_specials), types + [3] * len(extra_specials)     # control tokens
    elif vocab == "spm":
        tokens, types, scores = spm_vocab()
    elif vocab != "none":
        raise ValueError(f"vocab {vocab!r}")
    n_vocab = len(tokens) if tokens is not None else n_vocab_none
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(f"tiny-{vocab}-{weight_type}-{'gqa' if n_kv_heads != n_heads else 'mha'}")
    w.add_block_count(n_layers)
    w.add_context_length(context_length)
    w.add_embedding_length(d_model)
    w.add_feed_forward_length(d_ff)
    w.add_head_count(n_heads)
    w.add_head_count_kv(n_kv_heads)
    w.add_layer_norm_rms_eps(rms_eps)
    w.add_rope_freq_base(rope_base)
    w.add_rope_dimension_count(head_dim)
    if rope_scaling and rope_scaling[0] == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(rope_scaling[1]))
    w.add_vocab_size(n_vocab)
    w.add_file_type({"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9, "BF16": 32,
                     "mixed": 7, "mixed_qkv": 7, "k_mixed": 15}[weight_type])
    _tiny_vocab(w, vocab, pre, add_bos, tokens, types, merges, scores)

    _tiny_weights(w, weight_type, seed, n_vocab, d_model, d_ff, n_layers, n_heads, n_kv_heads, tied, rope_scaling)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
