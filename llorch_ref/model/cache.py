"""One unified cache per sequence: K/V for every layer, the RoPE tables and the causal mask."""
from __future__ import annotations

import functools
import mmap

import numpy as np

from ..errors import PromptError
from . import layers


def zeros_paged(xp, shape, dtype):
    """xp.zeros(shape, dtype), but for NumPy in anonymous memory advised against huge pages: its pages are
    committed as positions are written, 4 KiB at a time. (NumPy advises huge pages for large arrays, so the
    first token of a 7B cache of 4096 positions committed about 260 MB of 2 MiB pages.)"""
    if xp is not np or not hasattr(mmap, "MADV_NOHUGEPAGE"):
        return xp.zeros(shape, dtype=dtype)
    dtype = np.dtype(dtype)
    n = int(np.prod(shape)) * dtype.itemsize
    if n == 0:
        return np.zeros(shape, dtype=dtype)
    buf = mmap.mmap(-1, n)
    buf.madvise(mmap.MADV_NOHUGEPAGE)
    return np.frombuffer(buf, dtype=dtype).reshape(shape)


def visible_mask(xp, q_pos, k_pos, window: int = 0):
    """q_pos: [T, 1], k_pos: [1, S] int -> [T, S] f32 additive mask: 0 where visible, -inf elsewhere.
    Causal; with window > 0 also q - k < window (llama.cpp's LLAMA_SWA_TYPE_STANDARD, transformers' sliding
    window: a query sees itself and the window - 1 positions before it)."""
    seen = k_pos <= q_pos
    if window:
        seen = seen & (q_pos - k_pos < window)
    return xp.where(seen, xp.float32(0.0), xp.float32(-xp.inf)).astype(xp.float32)


def rope_tables(rope_angles, xp, n_ctx: int, rope_dim: int, base: float, freq_scale: float = 1.0, factors=None,
                attn_factor: float = 1.0, ramp=None):
    """rope_angles(xp, n_ctx, rope_dim, base, freq_scale, factors[, ramp=YaRN's]), times attn_factor
    (layers.rope_magnitude),
    built once per set of arguments and shared, read-only, by every cache of that shape: a new cache per prompt
    rebuilt them (6 ms of the default model's 128-token prefill, 3% of it, on AMD EPYC Zen 5)."""
    key = None if factors is None else tuple(float(f) for f in factors)
    return _rope_tables(rope_angles, xp, int(n_ctx), int(rope_dim), float(base), float(freq_scale), key,
                        float(attn_factor), None if ramp is None else tuple(float(r) for r in ramp))


@functools.lru_cache(maxsize=8)
def _rope_tables(rope_angles, xp, n_ctx, rope_dim, base, freq_scale, factors, attn_factor=1.0, ramp=None):
    yarn = {} if ramp is None else {"ramp": ramp}
    cos, sin = layers.rope_magnitude(xp, *rope_angles(xp, n_ctx, rope_dim, base, freq_scale, factors, **yarn),
                                     attn_factor)
    for t in (cos, sin):
        if isinstance(t, np.ndarray):
            t.flags.writeable = False
    return cos, sin


class Cache:
    """K/V preallocated as [L, n_ctx, KV, Hd] of `kv_dtype`; RoPE cos/sin [n_ctx, R/2] built once.

    `pos` is the number of positions already written. reset() starts a new sequence: it zeroes pos
    (and the stored K/V, so no stale entry can ever be read by a bug elsewhere).
    """

    def __init__(self, xp, cfg, n_ctx: int, kv_dtype="float32", ops=layers):
        self.xp, self.cfg, self.n_ctx = xp, cfg, int(n_ctx)
        self.kv_dtype = xp.dtype(kv_dtype)
        shape = (cfg.n_layers, self.n_ctx, cfg.n_kv_heads, cfg.head_dim)
        self.k = zeros_paged(xp, shape, self.kv_dtype)
        self.v = zeros_paged(xp, shape, self.kv_dtype)
        self.rope_angles = ops.rope_angles
        self.cos, self.sin = rope_tables(ops.rope_angles, xp, self.n_ctx, cfg.rope_dim, cfg.rope_base,
                                         cfg.rope_freq_scale, cfg.rope_freq_factors, cfg.rope_attn_factor,
                                         cfg.rope_yarn_ramp)
        # local (sliding-window) layers with their own RoPE base (Gemma 3): a second table, unscaled
        self.cos_local = self.sin_local = None
        if cfg.rope_base_local is not None:
            self.cos_local, self.sin_local = rope_tables(ops.rope_angles, xp, self.n_ctx, cfg.rope_dim,
                                                         cfg.rope_base_local)
        self.pos = 0
        self._memo = {}       # per forward step: the mask and RoPE rows every layer shares (cleared by advance)

    def reset(self):
        # only positions < pos were written since the last reset: zeroing them leaves no stale entry, and
        # untouched pages of a large preallocated cache stay unallocated
        self.k[:, :self.pos] = 0
        self.v[:, :self.pos] = 0
        self.pos = 0
        self._memo.clear()

    def check_room(self, n_new: int):
        if self.pos + n_new > self.n_ctx:
            raise PromptError(f"context full: {self.pos} positions used + {n_new} new > n_ctx={self.n_ctx}")

    def positions(self, n_new: int):
        """-> [T] int positions of the next n_new tokens."""
        return self.xp.arange(self.pos, self.pos + n_new)

    def tables(self, local: bool = False, seq_len: int | None = None):
        """-> the (cos, sin) tables [n_ctx, R/2] of a global layer, or of a local layer (local=True). seq_len: the
        sequence's length after the step the rows are for (default pos + 1, a one-token step); it picks
        LongRoPE's factor set and dynamic NTK's base (layers.step_rope), whose tables then hold the rows of
        positions below seq_len."""
        if local and self.cos_local is not None:
            return self.cos_local, self.sin_local
        cfg = self.cfg
        if not cfg.rope_by_length:
            return self.cos, self.sin
        n = self.pos + 1 if seq_len is None else int(seq_len)
        base, factors = layers.step_rope(n, cfg.rope_base, cfg.rope_dim, cfg.rope_freq_factors,
                                         cfg.rope_freq_factors_long, cfg.rope_ntk_factor, cfg.rope_orig_ctx)
        if base == cfg.rope_base and factors is cfg.rope_freq_factors:
            return self.cos, self.sin
        return rope_tables(self.rope_angles, self.xp, self.n_ctx if base == cfg.rope_base else n, cfg.rope_dim,
                           base, cfg.rope_freq_scale, factors, cfg.rope_attn_factor, cfg.rope_yarn_ramp)

    def rope_seq_len(self, n_new: int) -> int:
        """The sequence's length after a step of n_new tokens: what LongRoPE and dynamic NTK are chosen by."""
        return self.pos + n_new

    def rope_rows(self, n_new: int, local: bool = False):
        """-> cos, sin: [T, R/2] f32 for the next n_new positions (local: the local layers' table)."""
        key = ("rope", self.pos, n_new, local)
        if key not in self._memo:
            p = self.positions(n_new)
            cos, sin = self.tables(local, self.rope_seq_len(n_new))
            self._memo[key] = (cos[p], sin[p])
        return self._memo[key]

    def store(self, layer: int, k, v):
        """k, v: [T, KV, Hd] -> the cached [S, KV, Hd] keys and values of this layer (S = pos + T)."""
        t = k.shape[0]
        self.k[layer, self.pos:self.pos + t] = k
        self.v[layer, self.pos:self.pos + t] = v
        end = self.pos + t
        return (self.k[layer, :end].astype(self.xp.float32, copy=False),
                self.v[layer, :end].astype(self.xp.float32, copy=False))

    def mask(self, n_new: int, window: int = 0):
        """-> [T, S] f32: 0 where token i (at pos+i) may see position j (j <= pos+i, and with a sliding
        window, pos+i - j < window), else -inf."""
        key = ("mask", self.pos, n_new, window)
        if key not in self._memo:
            xp = self.xp
            q_pos = self.positions(n_new)[:, None]                      # [T, 1]
            k_pos = xp.arange(self.pos + n_new)[None, :]                # [1, S]
            self._memo[key] = visible_mask(xp, q_pos, k_pos, window)
        return self._memo[key]

    def advance(self, n_new: int):
        self.pos += n_new
        self._memo.clear()
