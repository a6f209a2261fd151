"""Planted bugs for the harness's own tests and sweeps.

plant_scale: a scale error in one weight matrix of a GGUF file, in place of its blocks: the block scales (d, and
m / dmin where the type has one) are multiplied by `factor`, so every dequantized weight of the matrix is
multiplied by it (up to the f16 rounding of the new scales). The rest of the file is untouched, so an engine
under test runs exactly the original quantization with one matrix off by a known amount.

    plant_scale("m.gguf", "m-up11x1.01.gguf", "blk.11.ffn_up.weight", 1.01)
"""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

from ..loaders.onnx_folder import OnnxGraph
from ..model import cache as cache_mod

# type name -> (bytes per block, byte offsets of the f16 scales that multiply every weight of the block)
SCALES = {"Q4_0": (18, (0,)), "Q4_1": (20, (0, 2)), "Q5_0": (22, (0,)), "Q5_1": (24, (0, 2)), "Q8_0": (34, (0,)),
          "Q2_K": (84, (80, 82)), "Q3_K": (110, (108,)), "Q4_K": (144, (0, 2)), "Q5_K": (176, (0, 2)),
          "Q6_K": (210, (208,))}


def plant_scale(src, dst, tensor: str, factor: float) -> Path:
    """Copy src to dst with every weight of `tensor` multiplied by factor (through its block scales)."""
    import gguf

    src, dst = Path(src), Path(dst)
    if src.resolve() == dst.resolve():
        raise ValueError("plant_scale writes a copy: dst must differ from src")
    shutil.copyfile(src, dst)
    reader = gguf.GGUFReader(dst, "r+")
    t = next((t for t in reader.tensors if t.name == tensor), None)
    if t is None:
        raise KeyError(f"{src}: no tensor {tensor!r}")
    kind = t.tensor_type.name
    if kind in ("F32", "F16"):
        t.data[...] = (t.data.astype(np.float32) * np.float32(factor)).astype(t.data.dtype)
    elif kind in SCALES:
        size, offsets = SCALES[kind]
        blocks = t.data.reshape(-1, size)
        for off in offsets:
            d = blocks[:, off:off + 2].copy().view(np.float16)
            blocks[:, off:off + 2] = (d.astype(np.float32) * np.float32(factor)).astype(np.float16).view(np.uint8)
    else:
        raise ValueError(f"{tensor}: type {kind} has no scale table here (known: F32, F16, {', '.join(SCALES)})")
    reader.data.flush()
    del reader
    return dst


# -- decode-only bugs: each fn(monkeypatch, n_prompt) patches llorch-ref's Cache for the run it wraps -------
def position_off_by_one_in_decode(mp, n_prompt):
    real = cache_mod.Cache.positions
    mp.setattr(cache_mod.Cache, "positions", lambda self, n: real(self, n) + (1 if n == 1 and self.pos else 0))


def kv_written_one_slot_late(mp, n_prompt):
    real = cache_mod.Cache.store

    def store(self, layer, k, v):
        if k.shape[0] != 1:
            return real(self, layer, k, v)
        self.k[layer, self.pos + 1], self.v[layer, self.pos + 1] = k[0], v[0]
        end = self.pos + 1
        return self.k[layer, :end].astype(np.float32), self.v[layer, :end].astype(np.float32)
    mp.setattr(cache_mod.Cache, "store", store)


def cache_not_reset(mp, n_prompt):
    mp.setattr(cache_mod.Cache, "reset", lambda self: self._memo.clear())


def rope_table_only_as_long_as_the_prompt(mp, n_prompt):
    real = cache_mod.Cache.tables

    def tables(self, local=False, seq_len=None):
        cos, sin = real(self, local, seq_len)
        last = n_prompt - 1                      # rows past the prompt repeat its last one
        return (np.concatenate([cos[:n_prompt], np.repeat(cos[last:last + 1], len(cos) - n_prompt, 0)]),
                np.concatenate([sin[:n_prompt], np.repeat(sin[last:last + 1], len(sin) - n_prompt, 0)]))
    mp.setattr(cache_mod.Cache, "tables", tables)


def sliding_window_off_by_one_in_decode(mp, n_prompt):
    real = cache_mod.Cache.mask
    mp.setattr(cache_mod.Cache, "mask", lambda self, n, window=0: real(self, n, window + 1 if n == 1 and window else window))


DECODE_BUGS = {  # name -> (plant, config changes the bug needs, where it must be named: (step, checkpoint, layer, tensor))
    "decode positions off by one": (position_off_by_one_in_decode, None, (1, "1B", 0, "q@step1")),
    "K/V written one slot late": (kv_written_one_slot_late, None, (1, "3", 0, "k_cache@step1")),
    "cache not reset between sequences": (cache_not_reset, None, (0, "1B", 0, "q")),
    "RoPE table only as long as the prompt": (rope_table_only_as_long_as_the_prompt, None, (1, "1B", 0, "q@step1")),
    "sliding window off by one in decode": (sliding_window_off_by_one_in_decode, {"sliding_window": 4},
                                            (1, "4", 0, "kq_soft_max@step1")),
}


# -- cache bugs: rows the attention reads changed after they were written -------------------------------------
def cache_rows_scaled_after_first_step(mp, n_prompt):
    """An eviction / ring-buffer bug: before decode step 2 writes, rows 0..3 of every layer's cache are scaled
    x1.5; the engine then decodes self-consistently on that cache."""
    real = cache_mod.Cache.store

    def store(self, layer, k, v):
        if k.shape[0] == 1 and self.pos == n_prompt + 1:
            self.k[layer, :4] *= 1.5
            self.v[layer, :4] *= 1.5
        return real(self, layer, k, v)
    mp.setattr(cache_mod.Cache, "store", store)


def cache_rows_scaled_in_the_prompt(mp, n_prompt):
    """A first-micro-batch bug: right after the prompt's rows are written, rows 0..3 of every layer's cache are
    scaled x1.5 (the engine's attention reads them so)."""
    real = cache_mod.Cache.store

    def store(self, layer, k, v):
        out = real(self, layer, k, v)
        if k.shape[0] > 1:
            self.k[layer, :4] *= 1.5
            self.v[layer, :4] *= 1.5
            end = self.pos + k.shape[0]
            out = self.k[layer, :end].astype(np.float32), self.v[layer, :end].astype(np.float32)
        return out
    mp.setattr(cache_mod.Cache, "store", store)


def stale_row_from_a_previous_sequence(mp, n_prompt):
    """The cache is not cleared between sequences, and the prompt's write skips row 2 where an earlier sequence
    left one: that row keeps the earlier sequence's K/V."""
    real = cache_mod.Cache.store

    def reset(self):
        self._memo.clear()
        self.pos = 0

    def store(self, layer, k, v):
        stale = self.pos == 0 and k.shape[0] > 2 and bool(np.any(self.k[layer, 2]))
        keep = (self.k[layer, 2].copy(), self.v[layer, 2].copy()) if stale else None
        out = real(self, layer, k, v)
        if keep is not None:
            self.k[layer, 2], self.v[layer, 2] = keep
            end = self.pos + k.shape[0]
            out = self.k[layer, :end].astype(np.float32), self.v[layer, :end].astype(np.float32)
        return out
    mp.setattr(cache_mod.Cache, "reset", reset)
    mp.setattr(cache_mod.Cache, "store", store)


CACHE_BUGS = {  # name -> (plant, where it must be named: (step, checkpoint, layer, tensor))
    "cache rows 0..3 scaled after decode step 1": (cache_rows_scaled_after_first_step, (2, "3", 0, "k_cache@step2")),
    "cache rows 0..3 scaled in the prompt": (cache_rows_scaled_in_the_prompt, (0, "3", 0, "k_cache")),
    "a stale row from a previous sequence": (stale_row_from_a_previous_sequence, (0, "3", 0, "k_cache")),
}


# -- planted changes in an ONNX Runtime GenAI folder ---------------------------------------------------------
def plant_onnx(src, dst, initializer: str, change) -> Path:
    """Copy an ONNX folder to dst with one initializer changed in place: change(array) edits a writable view of
    it (e.g. `lambda a: a.__imul__(1.05)` on a layer's weight scales, or a RoPE cache row set to another's)."""
    src, dst = Path(src), Path(dst)
    if dst.exists():
        raise ValueError(f"{dst} exists: plant_onnx writes a new folder")
    shutil.copytree(src, dst)
    g = OnnxGraph(dst)
    t = g.inits.get(initializer)
    if t is None or t.data_location != 1:
        raise KeyError(f"{src}: no external initializer {initializer!r}")
    info = {e.key: e.value for e in t.external_data}
    dt = {1: np.float32, 10: np.float16}[t.data_type]
    mm = np.memmap(dst / info["location"], dtype=np.uint8, mode="r+")
    off, n = int(info.get("offset", 0)), int(info["length"])
    change(mm[off:off + n].view(dt).reshape(list(t.dims)))
    mm.flush()
    del mm
    return dst
