"""Lazy weights: the GGUF stays memory-mapped; a layer's tensors are dequantized when the layer runs.

A forward pass walks the layers in order, so a least-recently-used cache smaller than the model would
evict every layer just before its next use and never hit. The cache therefore keeps the first entries
that fit in its budget and re-dequantizes the others each time ("fill, then keep"): with a budget of
the whole dequantized model it behaves like eager loading; with a budget of K layers, K of L layers are
served from memory. The quantized bytes stay in the page cache, shared with other processes.
"""
from __future__ import annotations

import numpy as np

from ..errors import ParameterError

STORAGE_DTYPES = ("float32", "float16", "bfloat16")


def storage_dtype(name: str):
    if name not in STORAGE_DTYPES:
        raise ParameterError(f"weight dtype {name!r} must be one of {', '.join(STORAGE_DTYPES)}")
    if name == "bfloat16":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def mem_available() -> int:
    """Bytes the kernel reports as available (MemAvailable), or 4 GiB where that cannot be read."""
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 << 30


def default_cache_bytes(full_bytes: int) -> int:
    """The whole dequantized model when it fits in half the available memory; otherwise nothing (a partial
    cache of a layer scan saves only its own fraction of the work, and the memory goes to the page cache)."""
    return full_bytes if full_bytes <= mem_available() // 2 else 0


class WeightCache:
    def __init__(self, budget_bytes: int, asked: bool = False):
        """asked: the budget is the user's (--weight-cache-mb), not default_cache_bytes' choice."""
        self.budget, self.used, self.asked = int(budget_bytes), 0, asked
        self.items: dict = {}
        self.hits = self.misses = 0

    def shrink_default(self, budget_bytes: int):
        """A backend that needs less than the default budget (numba: its kernels read the blocks) lowers it before
        anything is cached; a budget the user asked for stays."""
        if not self.asked and not self.items:
            self.budget = min(self.budget, int(budget_bytes))

    def get(self, key, make, nbytes, make_transient=None):
        """The cached value of key; else make() and keep it if nbytes fit in what is left of the budget;
        else make_transient() (default make()), used once and not kept."""
        v = self.items.get(key)
        if v is not None:
            self.hits += 1
            return v
        self.misses += 1
        if self.used + nbytes > self.budget:
            return (make_transient or make)()
        v = make()
        self.items[key] = v
        self.used += _nbytes(v)
        return v

    def keeps(self, key, nbytes) -> bool:
        """Whether key's value is kept, or will be on its first use (a lookup that neither counts nor makes
        anything): then reading it costs one dequantization in all, not one per use."""
        return key in self.items or self.used + nbytes <= self.budget

    def stats(self) -> dict:
        return {"budget_mb": round(self.budget / 2**20, 1), "budget_by": "user" if self.asked else "default", "used_mb": round(self.used / 2**20, 1),
                "entries": len(self.items), "hits": self.hits, "misses": self.misses}


def _nbytes(v) -> int:
    if isinstance(v, np.ndarray):
        return v.nbytes
    return sum(a.nbytes for a in vars(v).values() if isinstance(a, np.ndarray))


class LazyRows:
    """The token embedding: rows dequantized on lookup, `emb[ids]` -> [n, D] float32."""

    def __init__(self, tensor, shape, dequantize_rows):
        self.t, self.shape, self._rows = tensor, shape, dequantize_rows
        self.dtype = np.dtype(np.float32)
        self.ndim = 2

    def __getitem__(self, idx):
        idx = np.asarray(idx)                   # each id's row dequantized (a repeated id again: np.unique took longer)
        return self._rows(self.t, idx.ravel()).reshape(idx.shape + (self.shape[1],))


class StreamingLayer:
    """A layer the cache does not keep: each weight is dequantized when read and dropped after its use,
    so at most the matrices of one product are held at a time."""

    def __init__(self, i, deq_field):
        self._i, self._deq = i, deq_field

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        return self._deq(self._i, name)


class LazyLayers:
    """A sequence of layers: cached LayerWeights where the budget allows, StreamingLayer otherwise."""

    def __init__(self, n, make_layer, deq_field, layer_bytes, cache):
        self.n, self._make, self._deq, self.layer_bytes, self.cache = n, make_layer, deq_field, layer_bytes, cache

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self.n))]
        if not -self.n <= i < self.n:
            raise IndexError(i)
        i %= self.n
        return self.cache.get(("layer", i), lambda: self._make(i), self.layer_bytes,
                              lambda: StreamingLayer(i, self._deq))

    def __iter__(self):
        for i in range(self.n):
            yield self[i]

    def field(self, i, name):
        """One field of layer i, dequantized now and not cached (a backend that reads the others elsewhere)."""
        return self._deq(i % self.n, name)

    def keeps(self, i) -> bool:
        """Whether layer i's weights are (or will be) kept dequantized; else each read dequantizes anew."""
        return self.cache.keeps(("layer", i % self.n), self.layer_bytes)


class LazyWeights:
    """Same attributes as model.weights.Weights (tok_embd, layers, out_norm, output); arrays appear on use.
    pos_embd and out_norm_b (GPT-2) are read at load, small as they are, and set by the loader."""

    lazy = True
    pos_embd = out_norm_b = None

    def __init__(self, tok_embd, layers, out_norm, make_output, output_bytes, cache, full_bytes, dtype):
        self.tok_embd, self.layers, self.out_norm = tok_embd, layers, out_norm
        self._make_output, self._output_bytes = make_output, output_bytes
        self.cache, self.full_bytes, self.dtype = cache, full_bytes, dtype

    @property
    def output(self):
        return self.cache.get("output", self._make_output, self._output_bytes)

    def keeps_output(self) -> bool:
        return self.cache.keeps("output", self._output_bytes)

    def map(self, fn):
        return self                     # lazy weights stay on the CPU (numpy; numba wraps them, cupy refuses them)

    def info(self) -> dict:
        return {"lazy": True, "storage": str(self.dtype), "dequantized_mb": round(self.full_bytes / 2**20, 1),
                **self.cache.stats()}


def dequantize_rows(t, rows) -> np.ndarray:
    """rows of one GGUF matrix -> float32 [len(rows), D], reading only those rows' blocks."""
    data, kind = t.data, t.tensor_type.name
    if kind == "F32":
        return np.asarray(data[rows], dtype=np.float32)
    if kind == "F16":
        return np.asarray(data[rows]).astype(np.float32)
    if kind == "Q8_0":                  # as gguf-py's (d * q, 32 a block) in fewer calls: one token's row in a decode
        blocks = np.asarray(data[rows]).reshape(len(rows), -1, 34)          # step, where gguf-py's took 0.15 ms
        d = np.ascontiguousarray(blocks[..., :2]).view(np.float16).astype(np.float32)
        return (d * blocks[..., 2:].view(np.int8)).reshape(len(rows), -1)
    from gguf import quants

    out = quants.dequantize(np.asarray(data[rows]), t.tensor_type)
    return np.ascontiguousarray(out.reshape(len(rows), -1), dtype=np.float32)
