"""`convert --to gguf --dtype float32` of the default model: every tensor of the copy holds, bit for bit, what
gguf-py's dequantization (the oracle) makes of the source's blocks, and the metadata is the source's, value types
and all, but for general.file_type."""
import gguf
import numpy as np
from gguf import quants

from llorch_ref.loaders.gguf_file import open_reader


def test_the_default_f32_copy_holds_the_oracle_dequantization(default_model, default_f32):
    src, copy = open_reader(default_model), open_reader(default_f32)
    assert [t.name for t in copy.tensors] == [t.name for t in src.tensors]
    data = np.fromfile(default_f32, dtype=np.uint8)          # one read, not a page fault a page
    for a, b in zip(src.tensors, copy.tensors):
        assert b.tensor_type.name == "F32" and np.array_equal(a.shape, b.shape) and b.n_bytes == 4 * a.n_elements
        want = quants.dequantize(np.asarray(a.data), gguf.GGMLQuantizationType(int(a.tensor_type)))
        got = data[b.data_offset:b.data_offset + b.n_bytes]
        assert got.tobytes() == np.ascontiguousarray(want, dtype="<f4").tobytes(), b.name
    assert copy.metadata.keys() == src.metadata.keys()
    for k, v in src.metadata.items():
        if k == "general.file_type":
            assert copy.metadata[k] == 0                       # llama_ftype ALL_F32
            continue
        assert copy.value_types[k] == src.value_types[k], k
        assert np.array_equal(copy.metadata[k], v) if isinstance(v, np.ndarray) else copy.metadata[k] == v, k
