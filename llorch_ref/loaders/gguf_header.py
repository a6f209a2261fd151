"""A GGUF file's header read in one pass: metadata, tensor infos, and tensor data as views of one mapping.

gguf.GGUFReader builds a NumPy memmap view for every part of every field; on the default model, whose
vocabulary and merges are about 98,000 strings, that takes 2.5-4 s of a 3 s load. This reader parses the
same format (GGUF v2 and v3, little-endian) with `struct` over an mmap and gives the same values: metadata
as `read_metadata` returned them from GGUFReader (scalars as Python numbers, strings as str, string arrays
as lists, number arrays as NumPy arrays), tensors with GGUFReader's attributes (name, tensor_type in
gguf's enum, shape in ggml order, n_elements, n_bytes, data_offset, data shaped as GGUFReader shapes it).
tests/test_gguf_header.py checks both readers agree on every file the tests use. gguf-py stays the
source of the type constants (GGMLQuantizationType, GGML_QUANT_SIZES) and of dequantization.
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import ModelFileError
from ..model.ggml_types import block_size, ggml_type

# GGUF value types -> struct format of a scalar
SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
NP_OF = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
         7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
STRING, ARRAY = 8, 9
_U64 = struct.Struct("<Q")
ELEMENT_TYPES = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8, "I16": np.int16,
                 "I32": np.int32, "I64": np.int64}


class _Truncated(Exception):
    pass


@dataclass
class TensorInfo:
    """One tensor, with the attributes of gguf.ReaderTensor that llorch-ref reads."""
    name: str
    tensor_type: object          # model.ggml_types.GGMLType (gguf-py's GGMLQuantizationType for a type it lacks)
    shape: np.ndarray            # ggml order (ne0 first), as GGUFReader reports it
    n_elements: int
    n_bytes: int
    data_offset: int
    _file: "GGUFFile" = field(repr=False, default=None)

    @property
    def data(self) -> np.ndarray:
        """The tensor's bytes in the mapping (no copy): elements [ne_{n-1}, ..., ne0] for F16/F32/F64/I*,
        otherwise uint8 [..., row bytes], as GGUFReader shapes them."""
        raw = self._file.mapped[self.data_offset:self.data_offset + self.n_bytes]
        dims = tuple(int(d) for d in reversed(self.shape.tolist()))
        dtype = ELEMENT_TYPES.get(self.tensor_type.name)
        if dtype is not None:
            return raw.view(dtype).reshape(dims)
        block, size = block_size(self.tensor_type.name)
        return raw.reshape(dims[:-1] + (dims[-1] // block * size,))


@dataclass
class GGUFFile:
    path: Path
    version: int
    metadata: dict
    tensors: list
    alignment: int
    data_start: int
    mapped: np.ndarray = field(repr=False, default=None)     # the whole file, uint8, read-only
    mm: mmap.mmap = field(repr=False, default=None)          # the mapping itself (for madvise)
    value_types: dict = field(repr=False, default_factory=dict)  # key -> (GGUF value type, element type or None)


class _Cursor:
    def __init__(self, buf, offset, end):
        self.buf, self.o, self.end = buf, offset, end

    def take(self, fmt):
        n = struct.calcsize(fmt)
        if self.o + n > self.end:
            raise _Truncated
        v = struct.unpack_from(fmt, self.buf, self.o)[0]
        self.o += n
        return v

    def string(self):
        n = self.take("<Q")
        if self.o + n > self.end:
            raise _Truncated
        s = self.buf[self.o:self.o + n].decode("utf-8")
        self.o += n
        return s

    def value(self, vtype, key):
        if vtype in SCALARS:
            v = self.take(SCALARS[vtype])
            return float(v) if vtype in (6, 12) else v
        if vtype == STRING:
            return self.string()
        if vtype != ARRAY:
            raise ModelFileError(f"metadata key {key!r} has unknown value type {vtype}")
        etype, count = self.take("<I"), self.take("<Q")
        if etype in NP_OF:
            dt = np.dtype(NP_OF[etype]).newbyteorder("<")
            if self.o + count * dt.itemsize > self.end:
                raise _Truncated
            arr = np.frombuffer(self.buf, dtype=dt, count=count, offset=self.o).copy()
            self.o += count * dt.itemsize
            return arr
        if count * 8 > self.end - self.o:
            raise _Truncated
        if etype == STRING:
            return self.strings(count)
        return [self.value(etype, key) for _ in range(count)]

    def strings(self, count):
        """count strings in a row (a vocabulary: tens of thousands), in one tight loop."""
        buf, o, end, unpack, out = self.buf, self.o, self.end, _U64.unpack_from, []
        for _ in range(count):
            if o + 8 > end:
                raise _Truncated
            n = unpack(buf, o)[0]
            o += 8
            if o + n > end:
                raise _Truncated
            out.append(buf[o:o + n].decode("utf-8"))
            o += n
        self.o = o
        return out


def read_gguf(path) -> GGUFFile:
    """Parse a GGUF file's header (its magic, version and counts already checked by the caller) ->
    GGUFFile. Malformed or truncated headers raise ModelFileError with one line."""
    path = Path(path)
    with open(path, "rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    size = len(buf)
    cur = _Cursor(buf, 8, size)
    version = struct.unpack_from("<I", buf, 4)[0]
    try:
        n_tensors, n_kv = cur.take("<Q"), cur.take("<Q")
        meta, types = {}, {}
        for _ in range(n_kv):
            key = cur.string()
            if key in meta:
                raise ModelFileError(f"{path}: duplicate metadata key {key!r}")
            vtype = cur.take("<I")
            types[key] = (vtype, struct.unpack_from("<I", buf, cur.o)[0] if vtype == ARRAY and cur.o + 4 <= size
                          else None)
            meta[key] = cur.value(vtype, key)
        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            n_dims = cur.take("<I")
            if not 1 <= n_dims <= 4:
                raise ModelFileError(f"{path}: tensor {name!r} has {n_dims} dimensions (GGUF allows 1 to 4)")
            dims = [cur.take("<Q") for _ in range(n_dims)]
            infos.append((name, dims, cur.take("<I"), cur.take("<Q")))
    except _Truncated:
        raise ModelFileError(f"{path}: truncated: the header ends at byte {size} in the middle of a field") from None
    except UnicodeDecodeError as e:
        raise ModelFileError(f"{path}: a metadata string or tensor name is not UTF-8 ({e.reason})") from None
    alignment = meta.get("general.alignment", 32)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise ModelFileError(f"{path}: general.alignment {alignment!r} is not a power of two")
    start = -(-cur.o // alignment) * alignment
    mapped = np.frombuffer(buf, dtype=np.uint8)
    out = GGUFFile(path=path, version=version, metadata=meta, tensors=[], alignment=alignment, data_start=start,
                   mapped=mapped, mm=buf, value_types=types)
    out.tensors = [_tensor(path, out, *info) for info in infos]
    names = [t.name for t in out.tensors]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise ModelFileError(f"{path}: duplicated tensor name {dup!r}")
    return out


def _tensor(path, file, name, dims, raw_type, offset):
    try:
        qtype, (block, size) = ggml_type(raw_type)
    except ValueError:
        raise ModelFileError(f"{path}: tensor {name!r} has unknown ggml type {raw_type}") from None
    n = 1
    for d in dims:
        n *= d
    if dims[0] % block:
        raise ModelFileError(f"{path}: tensor {name!r}: row length {dims[0]} is not a multiple of {qtype.name}'s "
                             f"block of {block}")
    return TensorInfo(name=name, tensor_type=qtype, shape=np.array(dims, dtype=np.uint64), n_elements=n,
                      n_bytes=n // block * size, data_offset=file.data_start + offset, _file=file)
