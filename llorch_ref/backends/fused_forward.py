"""A backend's own forward: the reference's sequence of layer functions (model.forward) with the operations the
backend fuses (Fusions) where no recorder looks at the tensors.

Engine runs it only then (generation, logits without a recorder); a recorder that looks at tensors always gets
model.forward, so every checkpoint tensor exists. Its results differ from the reference's by rounding within the
backend's band: tests/test_backends.py checks the logits and every decode step against the numpy oracle.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from ..model import forward as ref


@dataclass(frozen=True)
class Fusions:
    """The fused operations a backend offers; None: that step as the layer functions compute it.

    attention_out(xp, q, k, v, mask, scale, kv_head) -> [T, H*Hd]: attention's output alone (no kq, no probs).
    rope_store_attend(xp, q, k, v, cos, sin, style, cache, layer, window, scale, kv_head) -> [T, H*Hd], or None
        where it does not take these shapes: RoPE, the cache write and attention in one.
    add_norm(xp, x, a, w, eps) -> (x + a, RMSNorm of it), a None: (x, RMSNorm of x): a residual add and the norm
        after it in one kernel; with it, a block hands its FFN output to the next block's first norm."""
    attention_out: Optional[Callable] = None
    rope_store_attend: Optional[Callable] = None
    add_norm: Optional[Callable] = None


def _no_boundary(name, layer, arr):
    pass


def add_norm(xp, ops, fusions, x, a, w, eps):
    """(x + a, its RMSNorm); a None: (x, RMSNorm of x). The backend's add_norm where it has one."""
    if fusions.add_norm is not None:
        return fusions.add_norm(xp, x, a, w, eps)
    if a is not None:
        x = x + a
    return x, ops.rms_norm(xp, x, w, eps)


def attend(xp, cfg, ops, fusions, q, k, v, cache, layer):
    """RoPE, the cache write and attention -> [T, H*Hd]: the backend's rope_store_attend where it takes these
    shapes, else RoPE and the write one by one, then attention_out (the output alone) or the layer functions'."""
    local = cfg.is_local(layer)
    cos, sin = cache.rope_rows(q.shape[0], local)                                        # [T, R/2]
    window = cfg.sliding_window if local else 0
    kv_head = ops.kv_head_of(xp, cfg.n_heads, cfg.n_kv_heads)
    if fusions.rope_store_attend is not None:
        att = fusions.rope_store_attend(xp, q, k, v, cos, sin, cfg.rope_style, cache, layer, window, cfg.scale,
                                        kv_head)
        if att is not None:
            return att
    q = ops.rope(xp, q, cos, sin, cfg.rope_style)                                        # [T, H, Hd]
    k = ops.rope(xp, k, cos, sin, cfg.rope_style)                                        # [T, KV, Hd]
    k_all, v_all = cache.store(layer, k, v)                                              # [S, KV, Hd]
    mask = cache.mask(q.shape[0], window)                                                # [T, S]
    if fusions.attention_out is None:
        return ops.attention(xp, q, k_all, v_all, mask, cfg.scale, kv_head)[0]
    return fusions.attention_out(xp, q, k_all, v_all, mask, cfg.scale, kv_head)


def block(xp, cfg, ops, fusions, lw, x, pending, cache, layer, out_rows=None):
    """x: [T, D] f32, pending: the previous block's FFN output not yet added (or None) -> (x, pending). With
    fusions.add_norm the FFN output is left to the next block's first norm (pending); else (the output, None)."""
    x, h = add_norm(xp, ops, fusions, x, pending, lw.attn_norm, cfg.rms_eps)            # [T, D]
    q, k, v = ref.project_qkv(xp, cfg, ops, lw, h, layer)
    att = ops.linear(xp, attend(xp, cfg, ops, fusions, q, k, v, cache, layer), lw.wo)    # [T, D]
    if out_rows is not None:
        att, x = att[out_rows], x[out_rows]                                              # [R, D]
    att = ref.post_norm(xp, cfg, ops, lw, att, "attn_post_norm", layer)
    x, h = add_norm(xp, ops, fusions, x, att, lw.ffn_norm, cfg.rms_eps)
    ffn = ref.feed_forward(xp, cfg, ops, lw, h, layer)
    if fusions.add_norm is not None:
        return x, ffn
    return x + ffn, None


def forward(xp, cfg, w, tokens, cache, ops, fusions, rows=None, boundary=None):
    """tokens: [T] int -> logits [R, V] f32 for `rows` (None: all), appending the tokens to `cache`, as
    model.forward does. boundary(name, layer, None) is called with "l_out" after each block (a recorder of the
    layer boundaries only, such as generation's cancel check)."""
    if cfg.norm != "rms" or not cfg.uses_rope:       # GPT-2 (LayerNorm, learned positions): no fusions, the steps
        return ref.forward(xp, cfg, w, tokens, cache, rows=rows, ops=ops, **({"record": boundary} if boundary else {}))
    boundary = boundary or _no_boundary
    t = len(tokens)
    cache.check_room(t)
    x = ref.embed(xp, cfg, w, tokens)
    last = len(w.layers) - 1
    out_rows = None if rows is None else xp.asarray(rows)
    pending = None
    for i, lw in enumerate(w.layers):
        x, pending = block(xp, cfg, ops, fusions, lw, x, pending, cache, i, out_rows if i == last else None)
        boundary("l_out", i, None)
    if pending is not None:
        x = x + pending
    cache.advance(t)
    return ref.head(xp, cfg, ops, w, x)
