"""Write a Llama-2-7B- or Llama-3-8B-shaped GGUF of random weights, deterministically, without a download.

    python tools/make_big_model.py --shape llama2-7b --type Q4_K --out /data/llama2-7b-random.Q4_K.gguf
    python tools/make_big_model.py --shape llama3-8b --type Q8_0 --out /data/llama3-8b-random.Q8_0.gguf

Shapes: llama2-7b (D 4096, F 11008, 32 layers, 32 heads, MHA, vocab 32000, SentencePiece-style 'llama'
vocabulary); llama3-8b (D 4096, F 14336, 32 layers, 32/8 heads (GQA), vocab 128256, BPE 'llama-bpe'
vocabulary, rope base 500000, Llama 3.1's rope scaling (factor 8) as rope_freqs.weight, the way
llama.cpp's converter writes it); 'small' (a few layers of the 7B widths, for quick checks), 'small-llama3' (two
layers of the 8B shape); 'smollm2-135m' (the default model's shape and block types: a tied Q8_0 embedding, its
matrices in --type, for timing on a machine that cannot fetch the default model). The quantized blocks are drawn
directly (seeded per tensor name, so every run writes the same bytes): Q8_0 int8 codes with one f16 scale per 32
weights, Q4_0 nibbles with one, Q4_1 nibbles with a scale and a minimum, Q4_K nibbles with random
6-bit sub-block scales and mins (Q2_K, Q3_K, Q6_K likewise with theirs), d and dmin set so the weights have the
standard deviation asked for;
--type Q4_K_M mixes Q4_K and Q6_K as llama.cpp's quantizer does (tensor_type), so that Q, K and V differ in type.
Norm weights are F32 near 1. The vocabulary is a small trained one (llorch_ref.testing.tiny) padded with
unused tokens to the full size, or, with --vocab-from FILE, every tokenizer.* key of another GGUF (its vocabulary
size must be the shape's): the default model's vocabulary travels in 2 MB where its 98 MB file cannot, and a
load then builds the same tokenizer as from the real file. Tensors are written one at a time (memory stays small).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from llorch_ref.model.ggml_types import block_size
from llorch_ref.testing.blocks import random_blocks, seeded_rng

SHAPES = {
    "llama2-7b": dict(d=4096, f=11008, layers=32, heads=32, kv=32, vocab=32000, ctx=4096, base=10000.0, vocab_kind="spm"),
    "llama3-8b": dict(d=4096, f=14336, layers=32, heads=32, kv=8, vocab=128256, ctx=131072, base=500000.0,
                      vocab_kind="bpe", rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                      "high_freq_factor": 4.0,
                                                      "original_max_position_embeddings": 8192}),
    # the default model's shape (SmolLM2-135M): tied Q8_0 embedding, for benches where its file can't be fetched
    "smollm2-135m": dict(d=576, f=1536, layers=30, heads=9, kv=3, vocab=49152, ctx=8192, base=100000.0,
                         vocab_kind="bpe", embed_type="Q8_0", tied=True),
    "small": dict(d=4096, f=11008, layers=2, heads=32, kv=32, vocab=32000, ctx=4096, base=10000.0, vocab_kind="spm"),
    "small-llama3": dict(d=4096, f=14336, layers=2, heads=32, kv=8, vocab=128256, ctx=131072, base=500000.0,
                         vocab_kind="bpe", rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                         "high_freq_factor": 4.0,
                                                         "original_max_position_embeddings": 8192}),
}
TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q2_K", "Q3_K", "Q4_K", "Q6_K")   # the block types random_blocks draws
MIXTURES = ("Q4_K_M",)                                  # --type values that mix them as llama.cpp's quantizer does


def more_bits(i, n):
    """llama.cpp's use_more_bits(i, n): the layers whose attn_v and ffn_down a Q4_K_M file keeps in Q6_K (the first
    and last eighth, and every third between)."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def tensor_type(qtype, kind, i, n_layers):
    """The block type of one matrix (kind: q, k, v, o, gate, up, down, output) in a file of --type qtype: Q4_K_M as
    llama_tensor_get_type chooses it (checked against llama.cpp's quantizer on a 32-layer model: Q6_K for the output,
    for attn_v and ffn_down of the layers more_bits names, Q4_K elsewhere); any other type throughout."""
    if qtype != "Q4_K_M":
        return qtype
    if kind == "output" or (kind in ("v", "down") and more_bits(i, n_layers)):
        return "Q6_K"
    return "Q4_K"


def vocab(kind, n):
    from llorch_ref.testing.tiny import bpe_vocab, spm_vocab
    if kind == "spm":
        tokens, types, scores = spm_vocab()
    else:
        tokens, types, merges = bpe_vocab()
        scores = None
    pad = n - len(tokens)
    if kind == "spm":
        tokens = tokens + [f"<unused{i}>" for i in range(pad)]
        types = types + [5] * pad                      # UNUSED: never produced by the tokenizer
        scores = scores + [-1e9] * pad
        return tokens, types, scores, None
    tokens = tokens + [f"<|reserved_special_token_{i}|>" for i in range(pad)]
    types = types + [3] * pad                          # CONTROL, as Llama 3's reserved tokens
    return tokens, types, None, merges


def copy_vocab(w, src, n_vocab):
    """Every tokenizer.* key of the GGUF `src`, with its value type, into the writer w."""
    import gguf

    fields = {k: f for k, f in gguf.GGUFReader(src).fields.items() if k.startswith("tokenizer.")}
    n = len(fields["tokenizer.ggml.tokens"].data) if "tokenizer.ggml.tokens" in fields else 0
    if n != n_vocab:
        raise SystemExit(f"make_big_model: {src} has {n} tokens; this shape's vocabulary has {n_vocab}")
    for key, f in fields.items():
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, f.contents(), f.types[0], sub_type=sub)


def write(path, shape="llama2-7b", qtype="Q4_K", seed=0, vocab_from=None):
    import gguf
    from tqdm import tqdm

    s = SHAPES[shape]
    d, f, L, h, kv, V = s["d"], s["f"], s["layers"], s["heads"], s["kv"], s["vocab"]
    hd = d // h
    path = Path(path)
    tmp = path.with_name(path.name + ".part")
    w = gguf.GGUFWriter(str(tmp), "llama")
    w.add_name(f"{shape}-random-{qtype}")
    w.add_block_count(L)
    w.add_context_length(s["ctx"])
    w.add_embedding_length(d)
    w.add_feed_forward_length(f)
    w.add_head_count(h)
    w.add_head_count_kv(kv)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(s["base"])
    w.add_rope_dimension_count(hd)
    w.add_vocab_size(V)
    w.add_file_type({"Q8_0": 7, "Q4_0": 2, "Q4_1": 3, "Q2_K": 10, "Q3_K": 12, "Q4_K": 15, "Q4_K_M": 15,
                     "Q6_K": 18}[qtype])
    tokens, types, scores, merges = vocab(s["vocab_kind"], V)
    if vocab_from:
        copy_vocab(w, vocab_from, V)
    elif s["vocab_kind"] == "spm":
        w.add_tokenizer_model("llama")
        w.add_token_scores(scores)
        w.add_unk_token_id(0)
        w.add_add_bos_token(True)
    else:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("llama-bpe")
        w.add_token_merges(merges)
        w.add_add_bos_token(False)
    if not vocab_from:
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
    norm = None                                        # each entry: name, shape, std of the weights, block type
    plan = [("token_embd.weight", (V, d), 0.02, s.get("embed_type", tensor_type(qtype, "embd", 0, L)))]
    for i in range(L):
        p, q = f"blk.{i}.", lambda kind, i=i: tensor_type(qtype, kind, i, L)     # noqa: E731
        plan += [(p + "attn_norm.weight", (d,), None, norm), (p + "attn_q.weight", (h * hd, d), 0.02, q("q")),
                 (p + "attn_k.weight", (kv * hd, d), 0.02, q("k")), (p + "attn_v.weight", (kv * hd, d), 0.02, q("v")),
                 (p + "attn_output.weight", (d, h * hd), 0.02, q("o")), (p + "ffn_norm.weight", (d,), None, norm),
                 (p + "ffn_gate.weight", (f, d), 0.02, q("gate")), (p + "ffn_up.weight", (f, d), 0.02, q("up")),
                 (p + "ffn_down.weight", (d, f), 0.02, q("down"))]
    plan.append(("output_norm.weight", (d,), None, norm))
    if not s.get("tied"):                              # tied: the output reuses token_embd, as the default model
        plan.append(("output.weight", (V, d), 0.02, tensor_type(qtype, "output", 0, L)))
    freqs = None
    if "rope_scaling" in s:
        from llorch_ref.loaders.hf_folder import rope_scaling_from_hf
        _, factors = rope_scaling_from_hf(s["rope_scaling"], s["base"], hd, shape)
        freqs = np.asarray(factors, dtype=np.float32)
        plan.append(("rope_freqs.weight", (hd // 2,), "freqs", None))
    for name, shp, std, ty in plan:
        if std is None or std == "freqs":
            w.add_tensor_info(name, shp, np.dtype(np.float32), shp[0] * 4)
        else:
            per, size = block_size(ty)
            if shp[1] % per:
                raise SystemExit(f"make_big_model: {name} has rows of {shp[1]}, not a multiple of {ty}'s {per}")
            w.add_tensor_info(name, (shp[0], shp[1] // per * size), np.dtype(np.uint8),
                              shp[0] * shp[1] // per * size, raw_dtype=gguf.GGMLQuantizationType[ty])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, shp, std, ty in tqdm(plan, desc=f"writing {path.name}", unit="tensor", file=sys.stderr):
        if std == "freqs":
            arr = freqs
        elif std is None:
            arr = (1.0 + 0.05 * seeded_rng(name, seed).standard_normal(shp)).astype(np.float32)
        else:
            arr = random_blocks(name, shp[0], shp[1], ty, std, seed)
        w.write_tensor_data(arr)
    w.close()
    tmp.rename(path)
    return path


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=list(SHAPES), default="llama2-7b")
    ap.add_argument("--type", choices=TYPES + MIXTURES, default="Q4_K")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab-from", metavar="GGUF", help="copy every tokenizer.* key of this file")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    t0 = time.perf_counter()
    p = write(a.out, a.shape, a.type, a.seed, a.vocab_from)
    print(f"wrote {p} ({p.stat().st_size / 2**30:.2f} GiB) in {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
