"""The fast GGUF header reader (loaders.gguf_header) against gguf-py's GGUFReader, the library it replaces
for reading: the same metadata values and types, the same tensor infos, the same bytes."""
import gguf
import numpy as np
import pytest

from llorch_ref.errors import ModelFileError
from llorch_ref.loaders.gguf_file import open_reader, read_metadata


def _library_metadata(r):
    out = {}
    for key, f in r.fields.items():
        if key.startswith("GGUF."):
            continue
        if f.types[0] == gguf.GGUFValueType.ARRAY and f.types[-1] != gguf.GGUFValueType.STRING:
            out[key] = np.array([f.parts[i][0] for i in f.data])
        else:
            out[key] = f.contents()
    return out


def _assert_same(path):
    ours, lib = open_reader(path), gguf.GGUFReader(str(path))
    meta, want = read_metadata(ours), _library_metadata(lib)
    assert meta.keys() == want.keys()
    for k, f in lib.fields.items():                    # the value types convert writes the copy's metadata with
        if not k.startswith("GGUF."):
            arr = f.types[0] == gguf.GGUFValueType.ARRAY
            assert ours.value_types[k] == (f.types[0], f.types[-1] if arr else None), k
    for k, v in want.items():
        if isinstance(v, np.ndarray):
            assert meta[k].dtype == v.dtype and np.array_equal(meta[k], v), k
        else:
            assert type(meta[k]) is type(v) and meta[k] == v, k
    assert [t.name for t in ours.tensors] == [t.name for t in lib.tensors]
    for a, b in zip(ours.tensors, lib.tensors):
        assert (a.tensor_type, a.n_bytes, a.data_offset, a.n_elements) == (b.tensor_type, b.n_bytes, b.data_offset,
                                                                           b.n_elements), a.name
        assert np.array_equal(a.shape, b.shape) and a.data.shape == b.data.shape and a.data.dtype == b.data.dtype
        assert np.array_equal(a.data.view(np.uint8), b.data.view(np.uint8)), a.name


def test_the_default_model_reads_as_gguf_py_reads_it(default_model):
    _assert_same(default_model)


@pytest.mark.parametrize("kw", [dict(weight_type="mixed", vocab="spm"), dict(weight_type="Q5_1", vocab="none"),
                                dict(weight_type="F16", rope_scaling=("freqs", 1))])
def test_tiny_models_read_as_gguf_py_reads_them(tiny, kw):
    _assert_same(tiny(**kw))


def test_a_header_cut_in_a_string_array_is_one_line_error(tiny, tmp_path):
    src = tiny(weight_type="Q4_0")
    data = src.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:open_reader(src).data_start // 2])      # inside the vocabulary's strings
    with pytest.raises(ModelFileError, match="truncated: the header ends"):
        open_reader(cut)
