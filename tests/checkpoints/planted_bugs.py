"""Planted bugs: each one is a mistake an engine author could make, applied with monkeypatch.

Every checkpoint test plants at least one and asserts that its own checkpoint is named as the first
divergence: a check that cannot fail proves nothing.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from llorch_ref.generate import sampling
from llorch_ref.model import cache as cache_mod
from llorch_ref.model import forward as forward_mod
from llorch_ref.model import layers


def _config(mp, eng, **kw):
    mp.setattr(eng, "config", dataclasses.replace(eng.config, **kw))


def add_bos(mp, eng):                        # cp0: a BOS the model's metadata says not to add
    mp.setattr(eng.tokenizer, "add_bos", True)


def wrong_rms_epsilon(mp, eng):              # cp1: 1e-6 instead of the file's 1e-5
    _config(mp, eng, rms_eps=1e-6)


def swapped_rope_style(mp, eng):             # cp1B: NeoX half-split on adjacent-pair (GGUF) weights
    _config(mp, eng, rope_style="neox")


def off_by_one_position(mp, eng):            # cp1B: positions start at 1
    def rope_rows(self, n_new, local=False):
        p = self.positions(n_new) + 1
        cos, sin = self.tables(local)
        return cos[p], sin[p]
    mp.setattr(cache_mod.Cache, "rope_rows", rope_rows)


def unpermuted_q_rows(mp, eng):              # cp2: HF (half-split) row order for Wq in a GGUF model
    hd, h = eng.config.head_dim, eng.config.n_heads
    for lw in eng.weights.layers:
        w = lw.wq.reshape(h, hd // 2, 2, -1).swapaxes(1, 2).reshape(lw.wq.shape)
        mp.setattr(lw, "wq", np.ascontiguousarray(w))


def stale_cache_entries(mp, eng):            # cp3: reset() rewinds pos but reads still reach old entries
    state = {"high": 0}

    def reset(self):
        self.pos = 0

    def store(self, layer, k, v):
        t = k.shape[0]
        self.k[layer, self.pos:self.pos + t] = k
        self.v[layer, self.pos:self.pos + t] = v
        state["high"] = end = max(state["high"], self.pos + t)
        return self.k[layer, :end], self.v[layer, :end]

    def mask(self, n_new, window=0):
        q = self.positions(n_new)[:, None]
        return np.where(np.arange(state["high"])[None, :] <= q, np.float32(0), np.float32(-np.inf))
    mp.setattr(cache_mod.Cache, "reset", reset)
    mp.setattr(cache_mod.Cache, "store", store)
    mp.setattr(cache_mod.Cache, "mask", mask)


def missing_gqa_repeat(mp, eng):             # cp4: query head h reads KV head h % KV (tile, not repeat)
    mp.setattr(layers, "kv_head_of", lambda xp, h, kv: xp.arange(h) % kv)


def wrong_attention_scale(mp, eng):          # cp4: 1/Hd instead of 1/sqrt(Hd)
    _config(mp, eng, attention_scale=1.0 / eng.config.head_dim)


def heads_merged_wrong(mp, eng):             # cp5: [H, T, Hd] flattened without moving T first
    orig = layers.attention

    def attention(xp, q, k, v, mask, scale, kv_head):
        out, kq, probs = orig(xp, q, k, v, mask, scale, kv_head)
        t, h = q.shape[0], q.shape[1]
        wrong = out.reshape(t, h, -1).transpose(1, 0, 2).reshape(t, -1)
        return wrong, kq, probs
    mp.setattr(layers, "attention", attention)


def gate_up_swapped(mp, eng):                # cp6: silu applied to the up projection
    orig = layers.swiglu
    mp.setattr(layers, "swiglu", lambda xp, x, wg, wu, wd: orig(xp, x, wu, wg, wd))


def missing_ffn_residual(mp, eng):           # cp7: the block returns the FFN output without the residual
    orig = forward_mod.block

    def block(xp, cfg, lw, x, cache, layer, record=forward_mod._noop, ops=layers, out_rows=None):
        seen = {}

        def rec(name, l, a):
            seen[name] = a
            if name != "l_out":
                record(name, l, a)
        orig(xp, cfg, lw, x, cache, layer, rec, ops, out_rows)
        out = seen["ffn_out"]                      # should be seen["ffn_inp"] + seen["ffn_out"]
        record("l_out", layer, out)
        return out
    mp.setattr(forward_mod, "block", block)


def final_norm_without_weight(mp, eng):      # cp8: output_norm weight not applied
    mp.setattr(eng.weights, "out_norm", np.ones_like(eng.weights.out_norm))


def last_row_off_by_one(mp, eng):            # cp9: rows=[T-1] selects T-2
    orig = forward_mod.forward

    def forward(xp, cfg, w, tokens, cache, rows=None, **kw):
        if rows is not None:
            rows = [max(r - 1, 0) for r in rows]
        return orig(xp, cfg, w, tokens, cache, rows=rows, **kw)
    mp.setattr(forward_mod, "forward", forward)


def greedy_takes_runner_up(mp, eng):         # cp10: off-by-one in the sort
    mp.setattr(sampling, "greedy", lambda logits: int(np.argsort(logits)[-2]))


def softmax_wrong_axis(mp, eng):             # cp11: normalized over positions instead of the vocabulary
    orig = sampling.softmax
    mp.setattr(sampling, "softmax", lambda logits, axis=-1: orig(logits, axis=0))


def decode_position_skips(mp, eng):          # cp12: single-token decode steps advance the cache by 2
    orig = cache_mod.Cache.advance

    def advance(self, n_new):
        orig(self, n_new + 1 if n_new == 1 else n_new)
    mp.setattr(cache_mod.Cache, "advance", advance)
