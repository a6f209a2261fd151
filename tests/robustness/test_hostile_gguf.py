"""Hostile GGUF files: every corruption gives one clear ModelFileError/UnsupportedModelError naming the
file, never a crash, a hang or an allocation sized by a lying header."""
from __future__ import annotations

import struct
import time

import numpy as np
import pytest

import llorch_ref
from llorch_ref.errors import LlorchError, ModelFileError


def write(tmp_path, name, data: bytes):
    p = tmp_path / name
    p.write_bytes(data)
    return p


def header(n_tensors, n_kv, version=3):
    return b"GGUF" + struct.pack("<IQQ", version, n_tensors, n_kv)


@pytest.mark.parametrize("n_tensors, n_kv, what", [(2 ** 63, 1, "tensors"), (1, 2 ** 63 - 1, "metadata keys"),
                                                   (2 ** 40, 0, "tensors"), (0, 2 ** 40, "metadata keys")])
def test_absurd_counts_are_refused_before_reading(tmp_path, n_tensors, n_kv, what):
    p = write(tmp_path, "counts.gguf", header(n_tensors, n_kv) + b"\0" * 64)
    t0 = time.perf_counter()
    with pytest.raises(ModelFileError, match=f"claims .* {what}") as e:
        llorch_ref.load(p)
    assert str(p) in str(e.value) and time.perf_counter() - t0 < 2


def test_string_length_past_the_end(tmp_path):
    key_len = struct.pack("<Q", 2 ** 50)
    p = write(tmp_path, "strlen.gguf", header(0, 1) + key_len + b"general.architecture")
    with pytest.raises(ModelFileError):
        llorch_ref.load(p)


def test_unknown_value_type(tmp_path):
    key = b"general.architecture"
    p = write(tmp_path, "vtype.gguf", header(0, 1) + struct.pack("<Q", len(key)) + key + struct.pack("<I", 99) + b"\0" * 16)
    with pytest.raises(ModelFileError):
        llorch_ref.load(p)


def _tensor_offset_field(data: bytes, name: bytes) -> int:
    """Byte position of the data-offset field of tensor `name` in the tensor-info section."""
    i = data.index(struct.pack("<Q", len(name)) + name)
    j = i + 8 + len(name)
    n_dims = struct.unpack_from("<I", data, j)[0]
    return j + 4 + 8 * n_dims + 4


def test_tensor_offset_past_the_end(tiny, tmp_path):
    data = bytearray(tiny(vocab="none").read_bytes())
    at = _tensor_offset_field(bytes(data), b"blk.0.attn_q.weight")
    struct.pack_into("<Q", data, at, 2 ** 40)
    with pytest.raises(ModelFileError, match="tensor 'blk.0.attn_q.weight'|truncated|malformed"):
        llorch_ref.load(write(tmp_path, "offset.gguf", bytes(data)))


def test_misaligned_tensor_offset(tiny, tmp_path):
    data = bytearray(tiny(vocab="none").read_bytes())
    at = _tensor_offset_field(bytes(data), b"blk.0.attn_q.weight")
    off = struct.unpack_from("<Q", data, at)[0]
    struct.pack_into("<Q", data, at, off + 4)
    with pytest.raises(ModelFileError):
        llorch_ref.load(write(tmp_path, "align.gguf", bytes(data)))


def test_duplicate_tensor_names(tiny, tmp_path):
    data = tiny(vocab="none").read_bytes()
    dup = data.replace(b"blk.0.attn_k.weight", b"blk.0.attn_q.weight", 1)
    with pytest.raises(ModelFileError):
        llorch_ref.load(write(tmp_path, "dup.gguf", dup))


def test_nan_in_weights(tmp_path):
    from llorch_ref.testing.tiny import write_tiny_model

    p = write_tiny_model(tmp_path / "ok.gguf", vocab="none")
    data = bytearray(p.read_bytes())
    import gguf
    r = gguf.GGUFReader(str(p))
    t = next(t for t in r.tensors if t.name == "blk.1.ffn_up.weight")
    struct.pack_into("<f", data, int(t.data_offset) + 40, float("nan"))
    bad = write(tmp_path, "nan.gguf", bytes(data))
    with pytest.raises(ModelFileError, match="NaN or Inf"):            # eager: found at load
        llorch_ref.load(bad, weights="eager")
    eng = llorch_ref.load(bad, weights="lazy")                         # lazy: found when layer 1 first runs
    with pytest.raises(ModelFileError, match="blk.1.ffn_up.weight.*NaN or Inf"):
        eng.logits([1, 2, 3])


@pytest.mark.parametrize("seed", range(3))
def test_fuzzed_files_fail_cleanly(tiny, tmp_path, seed):
    """Random byte flips, truncations and splices of a valid file: each load either works or raises one
    LlorchError; any other exception is a bug. Bounded: 150 cases per seed."""
    base = tiny(vocab="bpe", n_layers=1).read_bytes()
    rng = np.random.default_rng(seed)
    outcomes = {"loaded": 0, "clear error": 0}
    for case in range(150):
        data = bytearray(base)
        kind = case % 3
        if kind == 0:                                     # flip bytes in the header/metadata region
            for _ in range(int(rng.integers(1, 8))):
                i = int(rng.integers(0, min(len(data), 4096)))
                data[i] = int(rng.integers(0, 256))
        elif kind == 1:                                   # truncate anywhere
            data = data[: int(rng.integers(0, len(data)))]
        else:                                             # overwrite an 8-byte field with an extreme value
            i = int(rng.integers(8, min(len(data) - 8, 4096)))
            extremes = [0, 2 ** 31, 2 ** 63 - 1, 2 ** 64 - 1]
            data[i:i + 8] = struct.pack("<Q", extremes[int(rng.integers(0, len(extremes)))])
        p = write(tmp_path, f"fuzz{case}.gguf", bytes(data))
        t0 = time.perf_counter()
        try:
            eng = llorch_ref.load(p)                          # lazy weights: the first forward reads them
            eng.logits([0, 1, 2])
            outcomes["loaded"] += 1
        except LlorchError as e:
            outcomes["clear error"] += 1
            assert "\n" not in str(e) and str(e), repr(e)
        assert time.perf_counter() - t0 < 10, f"case {case} took too long"
        p.unlink()
    print(f"seed {seed}: {outcomes}")
    assert outcomes["clear error"] > 0


def _tensor_type_field(data: bytes, name: bytes) -> int:
    i = data.index(struct.pack("<Q", len(name)) + name)
    j = i + 8 + len(name)
    n_dims = struct.unpack_from("<I", data, j)[0]
    return j + 4 + 8 * n_dims


def test_unknown_tensor_type(tiny, tmp_path):
    data = bytearray(tiny(vocab="none").read_bytes())
    struct.pack_into("<I", data, _tensor_type_field(bytes(data), b"blk.0.attn_q.weight"), 250)
    with pytest.raises(ModelFileError):
        llorch_ref.load(write(tmp_path, "ttype.gguf", bytes(data)))


def test_shape_product_overflow(tiny, tmp_path):
    data = bytearray(tiny(vocab="none").read_bytes())
    name = b"blk.0.attn_q.weight"
    i = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    n_dims = struct.unpack_from("<I", data, i)[0]
    for d in range(n_dims):                            # every dimension 2^62: the product overflows int64
        struct.pack_into("<Q", data, i + 4 + 8 * d, 2 ** 62)
    t0 = time.perf_counter()
    with pytest.raises(ModelFileError):
        llorch_ref.load(write(tmp_path, "shape.gguf", bytes(data)))
    assert time.perf_counter() - t0 < 5


def test_regression_inconsistent_bpe_vocabulary(tiny, tmp_path):
    """Found by the fuzz test: a merge naming a token absent from the vocabulary made `tokenizers` raise a
    bare Exception ("Token `The` out of vocabulary"). Now one TokenizerError naming the file."""
    from llorch_ref.errors import TokenizerError
    from llorch_ref.tokenizer import from_gguf_metadata

    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-2", "tokenizer.ggml.tokens": ["T", "h"],
            "tokenizer.ggml.merges": ["Th e"]}
    with pytest.raises(TokenizerError, match="cannot be turned into a tokenizer"):
        from_gguf_metadata(meta, source="fuzzed.gguf")


def test_malformed_merge_and_repeated_token_text():
    """A merge without its space is one TokenizerError naming it; a token text the vocabulary repeats maps to its
    first id (llama.cpp's token_to_id keeps the first), so encoding gives that id."""
    from llorch_ref.errors import TokenizerError
    from llorch_ref.tokenizer import from_gguf_metadata

    base = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-2", "tokenizer.ggml.bos_token_id": 0,
            "tokenizer.ggml.eos_token_id": 1}
    with pytest.raises(TokenizerError, match="malformed merge 'ab'"):
        from_gguf_metadata({**base, "tokenizer.ggml.tokens": ["a", "b", "ab"], "tokenizer.ggml.merges": ["a b", "ab"]})
    tok = from_gguf_metadata({**base, "tokenizer.ggml.tokens": ["a", "b", "ab", "x", "ab"],
                              "tokenizer.ggml.merges": ["a b"]})
    assert tok.encode("ab", add_special=False) == [2]
