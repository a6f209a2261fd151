"""GGUF loading: hyper-parameters, ggml order, tied output, dequantization, and bad files."""
from __future__ import annotations

import struct

import numpy as np
import pytest

import llorch_ref
from llorch_ref.errors import ModelFileError, UnsupportedModelError
from llorch_ref.loaders.gguf_file import load_gguf


def test_config_from_metadata(tiny):
    m = load_gguf(tiny(n_heads=4, n_kv_heads=2, d_model=64, d_ff=96, n_layers=2))
    c = m.config
    assert (c.d_model, c.n_heads, c.n_kv_heads, c.head_dim, c.d_ff, c.n_layers) == (64, 4, 2, 16, 96, 2)
    assert c.n_rep == 2
    assert c.rope_style == "adjacent"          # GGUF llama weights: adjacent-pair RoPE, stated explicitly
    assert c.tied_output is False
    assert c.context_length == 128


def test_numpy_order_is_reversed_ggml_order(tiny):
    import gguf

    path = tiny(d_model=64, d_ff=96)
    r = gguf.GGUFReader(str(path))
    t = next(t for t in r.tensors if t.name == "blk.0.ffn_down.weight")
    assert list(t.shape) == [96, 64]                         # ggml ne: [in=F, out=D]
    m = load_gguf(path)
    assert m.weights.layers[0].w_down.shape == (64, 96)      # NumPy: [out=D, in=F]
    assert m.weights.layers[0].w_down.dtype == np.float32


def test_tied_output_shares_embedding(tiny):
    m = load_gguf(tiny(tied=True))
    assert m.config.tied_output
    assert m.weights.output is m.weights.tok_embd


@pytest.mark.parametrize("wt", ["F16", "Q8_0", "mixed"])
def test_dequantized_weights_match_gguf_package(tiny, wt):
    import gguf

    path = tiny(weight_type=wt)
    m = load_gguf(path)
    r = gguf.GGUFReader(str(path))
    t = next(t for t in r.tensors if t.name == "blk.1.attn_k.weight")
    expect = gguf.quants.dequantize(t.data, t.tensor_type).reshape(m.weights.layers[1].wk.shape)
    np.testing.assert_array_equal(m.weights.layers[1].wk, expect.astype(np.float32))
    assert m.tensor_types["blk.1.ffn_up.weight"] in ("F16", "Q8_0")


def test_missing_file(tmp_path):
    with pytest.raises(ModelFileError, match="no such file"):
        llorch_ref.load(tmp_path / "nope.gguf")


def test_not_gguf(tmp_path):
    p = tmp_path / "x.gguf"
    p.write_bytes(b"PK\x03\x04 this is a zip, not a model" * 10)
    with pytest.raises(ModelFileError, match="not a GGUF file"):
        llorch_ref.load(p)


def test_wrong_version(tmp_path):
    p = tmp_path / "v9.gguf"
    p.write_bytes(b"GGUF" + struct.pack("<I", 9) + b"\0" * 64)
    with pytest.raises(ModelFileError, match="version 9"):
        llorch_ref.load(p)


@pytest.mark.parametrize("frac", [0.01, 0.3, 0.999])
def test_truncated(tiny, tmp_path, frac):
    data = tiny().read_bytes()
    p = tmp_path / "cut.gguf"
    p.write_bytes(data[: int(len(data) * frac)])
    with pytest.raises(ModelFileError) as e:
        llorch_ref.load(p)
    assert str(p) in str(e.value)


def test_unsupported_architecture(tiny, tmp_path):
    data = tiny().read_bytes()
    p = tmp_path / "gpt.gguf"
    # same-length replacement of the architecture string ("llama" -> "gptjx") keeps the file valid
    p.write_bytes(data.replace(b"\x05\x00\x00\x00\x00\x00\x00\x00llama", b"\x05\x00\x00\x00\x00\x00\x00\x00gptjx", 1))
    with pytest.raises(UnsupportedModelError, match="architecture 'gptjx' is not supported"):
        llorch_ref.load(p)


def test_ggml_type_table_is_gguf_pys():
    """model.ggml_types restates gguf-py's types (so that a load need not import the gguf package): every type
    gguf-py knows has its number, name and block sizes there, and a number the table lacks is gguf-py's type.
    Planted: Q8_1's bytes per block (36 in older ggml, 40 in gguf-py 0.19) in the table -> fails."""
    import gguf

    from llorch_ref.model import ggml_types as T

    for t in gguf.GGMLQuantizationType:
        mine, sizes = T.ggml_type(int(t))
        assert (mine.name, int(mine), sizes) == (t.name, int(t), gguf.GGML_QUANT_SIZES[t]), t.name
        assert T.block_size(t.name) == gguf.GGML_QUANT_SIZES[t] and mine == t and hash(mine) == hash(t)
    assert set(T.GGMLType.__members__) == set(gguf.GGMLQuantizationType.__members__)
    with pytest.raises(ValueError):
        T.ggml_type(250)


LOAD_IMPORTS = """
import sys
import llorch_ref
e = llorch_ref.load(sys.argv[1])
print("gguf" in sys.modules)
"""


def test_loading_a_gguf_file_does_not_import_the_gguf_package(tiny):
    """gguf-py's import (its writer, vocabulary and YAML modules: 26 ms of the default model's load on Zen 5) is
    left to what needs its dequantization: a fresh process loading a model reads the header and the float tensors
    without it."""
    import subprocess
    import sys

    got = subprocess.run([sys.executable, "-c", LOAD_IMPORTS, str(tiny())], check=True, timeout=300,
                         capture_output=True, text=True)
    assert got.stdout.split()[0] == "False", got.stdout + got.stderr
