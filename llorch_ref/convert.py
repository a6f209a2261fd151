"""`llorch-ref convert --to gguf --dtype f32|f16 IN.gguf OUT.gguf`: a copy with every tensor dequantized.

Metadata is kept key by key (with its GGUF value type); only general.file_type changes. llama.cpp run on
the F32 copy computes plain float32 math, which is what the tight checkpoint bands are measured on.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from .errors import LlorchError, ParameterError
from .loaders.gguf_file import dequantize, open_reader

FILE_TYPES = {"f32": 0, "f16": 1}   # llama_ftype ALL_F32, MOSTLY_F16


def _copy_fields(reader, writer, file_type, overrides=None):
    import gguf

    overrides = dict(overrides or {})
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        if key == "general.file_type":
            writer.add_uint32(key, file_type)
            continue
        if key in overrides:
            writer.add_key_value(key, overrides.pop(key), field.types[0])
            continue
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            sub = field.types[-1]
            if sub == gguf.GGUFValueType.STRING:
                val = [bytes(field.parts[i]) for i in field.data]
            else:
                val = [field.parts[i].tolist()[0] for i in field.data]
            writer.add_key_value(key, val, vtype, sub_type=sub)
        elif vtype == gguf.GGUFValueType.STRING:
            writer.add_key_value(key, bytes(field.parts[field.data[0]]), vtype)
        else:
            writer.add_key_value(key, field.parts[field.data[0]].tolist()[0], vtype)
    if "general.file_type" not in reader.fields:
        writer.add_uint32("general.file_type", file_type)
    if overrides:
        raise ParameterError(f"metadata key(s) {', '.join(overrides)} not in the file; nothing to override")


def convert_gguf(src, dst, dtype="f32", overwrite=False, kv_overrides=None, tensor_fn=None) -> Path:
    """Write a dequantized copy. kv_overrides: {key: value} replaced in the metadata (same value type);
    tensor_fn(name, float32 array) -> array lets tools plant a change in chosen weights."""
    import gguf

    if dtype not in FILE_TYPES:
        raise ParameterError(f"--dtype {dtype!r} must be one of {', '.join(FILE_TYPES)}")
    src, dst = Path(src), Path(dst)
    if dst.exists() and not overwrite:
        raise LlorchError(f"{dst}: already exists (pass --overwrite to replace it)")
    if src.resolve() == dst.resolve():
        raise ParameterError("input and output are the same file")
    reader = open_reader(src)
    arch = reader.fields["general.architecture"].contents()
    tmp = dst.with_name(dst.name + ".part")
    writer = gguf.GGUFWriter(str(tmp), arch)
    _copy_fields(reader, writer, FILE_TYPES[dtype], kv_overrides)
    for t in reader.tensors:
        arr = dequantize(t)
        if tensor_fn is not None:
            arr = np.ascontiguousarray(tensor_fn(t.name, arr), dtype=np.float32)
        if dtype == "f16" and arr.ndim >= 2:      # ggml keeps norms (1-D) in F32 in f16 files
            arr = arr.astype(np.float16)
        writer.add_tensor(t.name, arr)
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp, dst)
    finally:
        if tmp.exists():
            tmp.unlink()
    return dst
