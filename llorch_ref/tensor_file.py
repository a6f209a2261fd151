"""A bounded reader of safetensors files from third parties: every float type engines write (F64, F32, F16,
BF16, F8_E4M3, F8_E5M2) read as float32, integers as int64, each tensor's bytes checked against its header
before anything is read, and the tensors memory-mapped (read when a comparison asks for them).

The safetensors library's NumPy loader refuses BF16 and F8 (NumPy has no such types) and reads every tensor at
once; a dump is an engine's output, often from a GPU engine in bfloat16, so this reads the format itself:
an 8-byte little-endian header length, a JSON header {name: {"dtype", "shape", "data_offsets": [begin, end]},
"__metadata__": {str: str}}, then the data.
"""
from __future__ import annotations

import mmap
import tempfile
import weakref
import zipfile
from pathlib import Path

import numpy as np

from .errors import DumpError
from .json_doc import json_object

MAX_HEADER = 100 * 2**20
PLAIN = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32,
         "I16": np.int16, "I8": np.int8, "U64": np.uint64, "U32": np.uint32, "U16": np.uint16, "U8": np.uint8,
         "BOOL": np.bool_}
WIDTH = {**{k: np.dtype(v).itemsize for k, v in PLAIN.items()}, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1}


def _f8_table(exp_bits: int, bias: int, finite_only: bool) -> np.ndarray:
    """float32 value of each of the 256 codes of an 8-bit float with `exp_bits` exponent bits (OCP FP8:
    E4M3 has no infinities and one NaN code per sign; E5M2 follows IEEE)."""
    man_bits = 7 - exp_bits
    out = np.empty(256, np.float32)
    for code in range(256):
        sign = -1.0 if code & 0x80 else 1.0
        e, m = (code >> man_bits) & ((1 << exp_bits) - 1), code & ((1 << man_bits) - 1)
        top = (1 << exp_bits) - 1
        if finite_only and e == top and m == (1 << man_bits) - 1:
            out[code] = np.nan
        elif not finite_only and e == top:
            out[code] = sign * np.inf if m == 0 else np.nan
        elif e == 0:
            out[code] = sign * (m / (1 << man_bits)) * 2.0 ** (1 - bias)
        else:
            out[code] = sign * (1 + m / (1 << man_bits)) * 2.0 ** (e - bias)
    return out


F8 = {"F8_E4M3": _f8_table(4, 7, True), "F8_E5M2": _f8_table(5, 15, False)}


def read_header(path: Path) -> tuple[dict, int]:
    """-> (the JSON header, the offset where the data starts); a file that is not safetensors is a DumpError."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise DumpError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
        n = int.from_bytes(head, "little")
        if n > min(MAX_HEADER, size - 8):
            raise DumpError(f"{path}: not a safetensors file (header length {n} is implausible for a file of "
                            f"{size} bytes)")
        raw = f.read(n)
    return json_object(raw, f"{path}: not a safetensors file: its header", DumpError), 8 + n


def _entry(path: Path, name: str, e, data_size: int) -> tuple[str, list, int, int]:
    """One header entry checked: a known dtype, a shape of non-negative ints, offsets inside the data whose span
    is exactly the shape's size."""
    if not isinstance(e, dict) or not {"dtype", "shape", "data_offsets"} <= set(e):
        raise DumpError(f"{path}: tensor {name!r}: header entry needs dtype, shape and data_offsets")
    dt, shape, off = e["dtype"], e["shape"], e["data_offsets"]
    if dt not in WIDTH:
        raise DumpError(f"{path}: tensor {name!r} has dtype {dt!r}; readable: {', '.join(WIDTH)}")
    if not (isinstance(shape, list) and len(shape) <= 8
            and all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2**40 for d in shape)):
        raise DumpError(f"{path}: tensor {name!r}: shape {str(shape)[:80]} is not a list of at most 8 sizes")
    if not (isinstance(off, list) and len(off) == 2 and all(isinstance(o, int) and not isinstance(o, bool)
                                                               for o in off) and 0 <= off[0] <= off[1] <= data_size):
        raise DumpError(f"{path}: tensor {name!r}: data_offsets {str(off)[:80]} lie outside the file's "
                        f"{data_size} data bytes")
    want = int(np.prod(shape, dtype=np.int64)) * WIDTH[dt]
    if off[1] - off[0] != want:
        raise DumpError(f"{path}: tensor {name!r}: {off[1] - off[0]} data bytes for shape {shape} of {dt} "
                        f"({want} bytes)")
    return dt, shape, off[0], off[1]


def _as_array(raw: np.ndarray, dt: str, shape: list) -> np.ndarray:
    """The raw bytes of one tensor -> float32 (any float type) or int64 (integers, booleans), in its shape."""
    if dt == "BF16":
        a = (raw.view("<u2").astype(np.uint32) << 16).view(np.float32)
    elif dt in F8:
        a = F8[dt][raw]
    else:
        a = raw.view(np.dtype(PLAIN[dt]).newbyteorder("<"))
        a = a.astype(np.float32 if a.dtype.kind == "f" else np.int64)
    return a.reshape(shape)


def _read_span(path: Path, begin: int, end: int) -> np.ndarray:
    """Bytes [begin, end) of a file as a fresh uint8 array, through a memory map of that span alone (unmapped
    when it is copied out, so the file's pages never stay in the process's resident set)."""
    if end <= begin:
        return np.zeros(0, np.uint8)
    page = mmap.ALLOCATIONGRANULARITY
    at = begin - begin % page
    m = np.memmap(path, dtype=np.uint8, mode="r", offset=at, shape=(end - at,))
    out = np.array(m[begin - at:], copy=True)
    del m
    return out


class ReadOnLookup(dict):
    """A dict whose stored values stand for arrays kept elsewhere (a file's span, a .npy file): looking a name up
    reads its array (the subclass's __getitem__), and so do iteration's consumers, items, values, get and pop;
    the stored values themselves are never handed out."""

    def __iter__(self):                    # dict(store) then reads each array (not the stored stand-ins)
        return iter(self.keys())

    def items(self):
        return [(k, self[k]) for k in self.keys()]

    def values(self):
        return [self[k] for k in self.keys()]

    def get(self, name, default=None):
        return self[name] if name in self else default

    def pop(self, name, *default):
        if name not in self:
            return super().pop(name, *default)
        a = self[name]
        super().pop(name)
        return a


class LazyTensors(ReadOnLookup):
    """name -> array, read from the file each time a name is looked up (dict's other views read every tensor),
    and never kept: a comparison holds one tensor at a time, whatever the file's size. The file is checked
    whole when opened; the bytes are only read where asked for (read_rows: a span of rows)."""

    def __init__(self, path: Path, entries: dict, start: int):
        super().__init__({name: None for name in entries})
        self._path, self._entries, self._start = path, entries, start

    def __getitem__(self, name):
        super().__getitem__(name)                         # KeyError for a name the file does not hold
        dt, shape, b, e = self._entries[name]
        return _as_array(_read_span(self._path, self._start + b, self._start + e), dt, shape)

    def read_rows(self, name, a: int, b: int, n_rows: int) -> np.ndarray:
        """Rows a..b-1 of a tensor whose bytes hold n_rows equal rows (its first axis in C order, or its last
        in ggml's order, which is the same bytes) -> float32/int64 [b - a, row size]."""
        dt, shape, b0, e0 = self._entries[name]
        per = (e0 - b0) // n_rows
        raw = _read_span(self._path, self._start + b0 + a * per, self._start + b0 + b * per)
        return _as_array(raw, dt, [b - a, per // WIDTH[dt]])

    def shape(self, name) -> list:
        """The tensor's shape as its header gives it, without reading it."""
        return list(self._entries[name][1])

    def kind(self, name) -> str:
        """The NumPy kind the tensor reads as ('f' float32, 'i' int64), without reading it."""
        dt = self._entries[name][0]
        return "f" if dt.startswith(("F", "BF")) else ("b" if dt == "BOOL" else "i")


def read_tensors(path) -> tuple[LazyTensors, dict]:
    """-> (the tensors, read on demand; the header's __metadata__ dict). Every header entry is checked first."""
    path = Path(path)
    header, start = read_header(path)
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise DumpError(f"{path}: __metadata__ must map names to strings")
    data_size = path.stat().st_size - start
    entries = {name: _entry(path, name, e, data_size) for name, e in header.items()}
    return LazyTensors(path, entries, start), meta


class CountsLive:
    """Counts the arrays it hands out (through _track) that are still alive, `live`, and the most alive at once,
    `peak_live`: what a test of bounded memory reads."""

    live = peak_live = 0

    def _track(self, a):
        self.live += 1
        self.peak_live = max(self.peak_live, self.live)
        weakref.finalize(a, self._untrack)
        return a

    def _untrack(self):
        self.live -= 1


class RowWriter:
    """SpillStore.row_writer's writer: parts appended to one .npy file, the name held on close() once the
    bytes add up to the shape (a context manager: closed on leaving it; a short tensor is a DumpError)."""

    def __init__(self, store, name, path: Path, shape: tuple, dt: np.dtype):
        self.store, self.name, self.path, self.shape, self.dt = store, name, path, shape, dt
        self.want = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        self.written = 0
        self._f = open(path, "wb")
        np.lib.format.write_array_header_2_0(self._f, {"descr": dt.str, "fortran_order": False, "shape": shape})

    def write(self, part):
        b = np.ascontiguousarray(part, dtype=self.dt)
        if self.written + b.nbytes > self.want:
            raise DumpError(f"{self.name}: parts beyond its shape {list(self.shape)}")
        self._f.write(memoryview(b).cast("B"))
        self.written += b.nbytes

    def close(self):
        if self._f.closed:
            return
        self._f.close()
        if self.written != self.want:
            raise DumpError(f"{self.name}: {self.written} of its {self.want} bytes written")
        self.store._hold(self.name, self.path, self.shape, self.dt)

    def __enter__(self):
        return self

    def __exit__(self, kind, *rest):
        if kind is None:
            self.close()
        else:
            self._f.close()


class SpillStore(ReadOnLookup, CountsLive):
    """name -> array kept in a temporary folder (one .npy file each) instead of memory: a long prompt's dump
    (every row of every layer) is written as it is recorded and read back one tensor at a time. Looking a
    name up reads the file into a fresh array (never kept); read_rows reads a span of rows; write_rows
    writes a tensor chunk by chunk (its rows never all in memory). `live`/`peak_live`: the arrays read from
    the store still alive now and at most (what a test of bounded memory counts). The folder is removed when
    the store is garbage-collected."""

    def __init__(self, prefix: str = "llorch-spill-"):
        super().__init__()
        self._tmp = tempfile.TemporaryDirectory(prefix=prefix)
        self._dir = Path(self._tmp.name)
        self._n = 0

    def _path(self) -> Path:
        self._n += 1
        return self._dir / f"{self._n}.npy"

    def __setitem__(self, name, a):
        a = np.ascontiguousarray(a)
        path = self._path()
        np.save(path, a, allow_pickle=False)
        super().__setitem__(name, (path, tuple(a.shape), a.dtype.str))

    def write_rows(self, name, shape, dtype, chunks):
        """A tensor of `shape` written from `chunks` (arrays whose rows follow each other in C order)."""
        with self.row_writer(name, shape, dtype) as w:
            for c in chunks:
                w.write(c)

    def row_writer(self, name, shape, dtype) -> "RowWriter":
        """-> a writer of a tensor of `shape` whose parts are handed over one after another (write(part): rows
        in C order), for a producer that pushes them (a forward's logits, a span of rows at a time). The name
        is held once the writer is closed with every byte written."""
        return RowWriter(self, name, self._path(), tuple(int(n) for n in shape), np.dtype(dtype))

    def _hold(self, name, path, shape, dt):
        super().__setitem__(name, (path, tuple(shape), dt.str))

    def __getitem__(self, name):
        path, _, _ = super().__getitem__(name)
        return self._track(np.load(path, allow_pickle=False))

    def read_rows(self, name, a: int, b: int, n_rows: int) -> np.ndarray:
        """Rows a..b-1 of a tensor whose bytes hold n_rows equal rows -> [b - a, row size] in its dtype."""
        path, shape, dt = super().__getitem__(name)
        size = int(np.prod(shape, dtype=np.int64)) * np.dtype(dt).itemsize
        start = path.stat().st_size - size                   # the data follows the .npy header
        per = size // n_rows
        raw = _read_span(path, start + a * per, start + b * per)
        return self._track(raw.view(np.dtype(dt)).reshape(b - a, -1))

    def __delitem__(self, name):
        """The name dropped and its file deleted (a part copied elsewhere gives its disk back at once)."""
        path, _, _ = super().__getitem__(name)
        super().__delitem__(name)
        path.unlink(missing_ok=True)

    def shape(self, name) -> list:
        return list(super().__getitem__(name)[1])

    def kind(self, name) -> str:
        return np.dtype(super().__getitem__(name)[2]).kind

    def nbytes(self) -> int:
        """The bytes the store holds on disk."""
        return sum(int(np.prod(s, dtype=np.int64)) * np.dtype(d).itemsize for _, s, d in dict.values(self))



def write_npz(path, items):
    """items: (name, array) pairs, consumed one after another -> a compressed .npz (np.savez_compressed's
    format: a deflated zip64 member name.npy each), each array written as its turn comes and dropped after:
    a generator that reads each from disk keeps one in memory at a time, whatever the run's length."""
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED, allowZip64=True) as z:
        for name, a in items:
            with z.open(f"{name}.npy", "w", force_zip64=True) as f:
                np.lib.format.write_array(f, np.asanyarray(a), allow_pickle=False)
            del a


def npy_header(f) -> tuple[tuple, np.dtype]:
    """-> (shape, dtype) of an .npy stream, read past its header (the data follows)."""
    version = np.lib.format.read_magic(f)
    read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
    shape, fortran, dtype = read(f)
    if fortran:
        raise DumpError("an .npy member in Fortran order: not as llorch-ref writes it")
    return tuple(shape), dtype


class NpzTensors(ReadOnLookup, CountsLive):
    """name -> array of one or more .npz files' members, read from the file each time a name is looked up and
    never kept (a bundle of a long run: one tensor in memory at a time). members: {name: (path, member)};
    shapes and dtypes come from the members' headers, read without their data."""

    def __init__(self, members: dict, error=DumpError):
        """error: the exception (one line) a damaged member raises when it is read."""
        super().__init__({name: None for name in members})
        self._members, self._error = dict(members), error
        self._heads = {}
        for name, (path, member) in self._members.items():
            with zipfile.ZipFile(path) as z, z.open(member) as f:
                self._heads[name] = npy_header(f)

    @classmethod
    def joined(cls, parts, error=DumpError) -> "NpzTensors":
        """Several files' tensors as one mapping (none of them read)."""
        members = {}
        for p in parts:
            members.update(p._members)
        return cls(members, error)

    def __getitem__(self, name):
        super().__getitem__(name)                         # KeyError for a name no file holds
        path, member = self._members[name]
        try:
            with zipfile.ZipFile(path) as z, z.open(member) as f:
                return self._track(np.lib.format.read_array(f, allow_pickle=False))
        except (ValueError, OSError, EOFError, zipfile.BadZipFile, RuntimeError) as e:
            raise self._error(f"{path}: {name} is damaged or truncated ({type(e).__name__}: {str(e)[:120]})") from None

    def read_rows(self, name, a: int, b: int, n_rows: int) -> np.ndarray:
        """Rows a..b-1 of a tensor whose bytes hold n_rows equal rows -> [b - a, row size]: the member inflated
        as far as row b, the rows before a skipped a span at a time (never the whole tensor in memory)."""
        path, member = self._members[name]
        shape, dt = self._heads[name]
        per = int(np.prod(shape, dtype=np.int64)) * dt.itemsize // n_rows
        with zipfile.ZipFile(path) as z, z.open(member) as f:
            npy_header(f)
            skip = a * per
            while skip:
                skip -= len(f.read(min(skip, 16 * 2**20)))
            raw = f.read((b - a) * per)
        if len(raw) != (b - a) * per:
            raise DumpError(f"{path}: {name} is truncated")
        return self._track(np.frombuffer(raw, dtype=dt).reshape(b - a, -1))

    def shape(self, name) -> list:
        return list(self._heads[name][0])

    def kind(self, name) -> str:
        return self._heads[name][1].kind
