"""block() and forward(): the whole model, with an optional recorder for checkpoints.

The recorder is an observer: `record(name, layer, array)` is called with every checkpoint tensor
(layer None outside the blocks). A recorder that looks at tensors always gets the operation-by-operation path;
without one (generation), a backend may fuse operations whose tensors nobody sees (cupy: the residual add with the
next RMSNorm; with float16 weights, RoPE, the cache write and attention of a prefill, and activations that only
feed float16 products carried in float16), with results that differ by rounding, within that backend's band.
"""
from __future__ import annotations

from . import layers as L


def _noop(name, layer, arr):
    pass


def observes_tensors(record) -> bool:
    """Whether a recorder looks at the tensors (a checkpoint capture) or only at the layer boundaries (a
    recorder with `tensors = False`, such as generation's cancel check): if not, a backend may fuse operations (and
    such a recorder may be handed None for an array a fused path never formed)."""
    return record is not _noop and getattr(record, "tensors", True)


def block(xp, cfg, lw, x, cache, layer: int, record=_noop, ops=L, out_rows=None, residual=None):
    """x: [T, D] f32 -> (x, None): the block's output [T, D] f32, or [R, D] with out_rows (one block; writes this
    layer's K/V). Where nobody watches and the backend fuses add_norm, the FFN's output is not added here: -> (x, ffn),
    and the next block, given it as `residual`, adds it in its first norm's kernel (forward adds the last one).

    ops: the namespace of layer functions (default: model.layers, the reference; numerics="ggml" passes
    llama.cpp's CPU kernels). out_rows: keep only these rows after attention, as llama.cpp does in
    its last layer (the FFN then runs on the rows whose logits are wanted).
    Architecture switches (Config): qkv_bias (Qwen2); qk_norm, post_norms, ffn_act, local layers (Gemma 3)."""
    t = x.shape[0]
    local = cfg.is_local(layer)
    watched = observes_tensors(record)
    fused = None if watched else getattr(ops, "add_norm", None)                         # a backend's, unwatched
    x, h = _add_norm(xp, ops, x, residual, lw.attn_norm, cfg.rms_eps, fused)             # [T, D]
    record("attn_norm", layer, h)
    q, k, v = ops.qkv(xp, h, lw.wq, lw.wk, lw.wv, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim)
    if cfg.qkv_bias:                                                                     # Qwen2
        q, k, v = (q + lw.bq.reshape(q.shape[1:]), k + lw.bk.reshape(k.shape[1:]), v + lw.bv.reshape(v.shape[1:]))
    record("q_proj", layer, q); record("k_proj", layer, k); record("v", layer, v)
    if cfg.qk_norm:                                                                      # Gemma 3: per head, over Hd
        q = ops.rms_norm(xp, q, lw.q_norm, cfg.rms_eps)                                  # [T, H, Hd]
        k = ops.rms_norm(xp, k, lw.k_norm, cfg.rms_eps)                                  # [T, KV, Hd]
        record("q_normed", layer, q); record("k_normed", layer, k)
    cos, sin = cache.rope_rows(t, local)                                               # [T, R/2]
    window = cfg.sliding_window if local else 0
    kv_head = ops.kv_head_of(xp, cfg.n_heads, cfg.n_kv_heads)
    att = None if watched or not hasattr(ops, "rope_store_attend") else ops.rope_store_attend(
        xp, q, k, v, cos, sin, cfg.rope_style, cache, layer, window, cfg.scale, kv_head)  # a backend's fused path
    if att is None:
        att = _rope_store_attend(xp, cfg, ops, q, k, v, cos, sin, cache, layer, window, kv_head, record, watched)
    att = ops.linear(xp, att, lw.wo)                                                     # [T, D]
    record("attn_out", layer, att)
    if out_rows is not None:
        att, x = att[out_rows], x[out_rows]                                              # [R, D]
    if cfg.post_norms:                                                                   # Gemma 3
        att = ops.rms_norm(xp, att, lw.post_attn_norm, cfg.rms_eps)
        record("attn_post_norm", layer, att)
    x, h = _add_norm(xp, ops, x, att, lw.ffn_norm, cfg.rms_eps, fused)
    record("ffn_inp", layer, x); record("ffn_norm", layer, h)
    glu = ops.swiglu if cfg.ffn_act == "silu" else ops.geglu
    ffn, hidden = glu(xp, h, lw.w_gate, lw.w_up, lw.w_down)                             # [T, D], [T, F]
    record("ffn_swiglu", layer, hidden); record("ffn_out", layer, ffn)
    if cfg.post_norms:
        ffn = ops.rms_norm(xp, ffn, lw.post_ffn_norm, cfg.rms_eps)
        record("ffn_post_norm", layer, ffn)
    if fused is not None:                             # the next block's first norm adds ffn (forward after the last)
        record("l_out", layer, None)                  # the boundary, for a recorder that watches boundaries only
        return x, ffn
    x = x + ffn
    record("l_out", layer, x)
    return x, None


def _add_norm(xp, ops, x, a, w, eps, fused):
    """(x + a, its RMSNorm), a None: (x, RMSNorm of x). fused: a backend's add_norm, given only where nobody watches
    (one kernel; its normed rows may come in the precision of the products they feed, float16 on float16 weights)."""
    if fused is not None:
        return fused(xp, x, a, w, eps)
    if a is not None:
        x = x + a
    return x, ops.rms_norm(xp, x, w, eps)


def _rope_store_attend(xp, cfg, ops, q, k, v, cos, sin, cache, layer, window, kv_head, record, watched):
    """RoPE, the cache write and attention, operation by operation (each a checkpoint) -> [T, H*Hd]. The mask is
    asked for after the write (a cache may build it from what it holds)."""
    q = ops.rope(xp, q, cos, sin, cfg.rope_style)                                        # [T, H, Hd]
    k = ops.rope(xp, k, cos, sin, cfg.rope_style)                                        # [T, KV, Hd]
    record("q", layer, q); record("k", layer, k)
    k_all, v_all = cache.store(layer, k, v)                                            # [S, KV, Hd]
    record("k_cache", layer, k_all); record("v_cache", layer, v_all)
    mask = cache.mask(q.shape[0], window)                                              # [T, S]
    if watched or not hasattr(ops, "attention_out"):
        att, kq, probs = ops.attention(xp, q, k_all, v_all, mask, cfg.scale, kv_head)  # [T, H*Hd]
        record("kq", layer, kq); record("kq_soft_max", layer, probs); record("kqv_out", layer, att)
        return att
    return ops.attention_out(xp, q, k_all, v_all, mask, cfg.scale, kv_head)  # nobody looks at kq or probs


def forward(xp, cfg, w, tokens, cache, rows=None, record=_noop, ops=L):
    """tokens: [T] int -> logits [R, V] f32 for `rows` (indices into the T new tokens; None = all).

    Appends the T tokens to the sequence held by `cache` (positions cache.pos .. cache.pos+T-1).
    """
    t = len(tokens)
    cache.check_room(t)
    x = w.tok_embd[xp.asarray(tokens)].astype(xp.float32, copy=False)                  # [T, D]
    if cfg.embed_scale is not None:                                                      # Gemma: x sqrt(D)
        x = x * xp.float32(cfg.embed_scale)
    record("embd", None, x)
    last = len(w.layers) - 1
    out_rows = None if rows is None else xp.asarray(rows)
    rest = None
    for i, lw in enumerate(w.layers):
        x, rest = block(xp, cfg, lw, x, cache, i, record, ops, out_rows if i == last else None, rest)
    if rest is not None:
        x = x + rest
    cache.advance(t)
    x = ops.rms_norm(xp, x, w.out_norm, cfg.rms_eps)
    record("result_norm", None, x)
    logits = ops.linear(xp, x, w.output)                                                 # [R, V]
    record("result_output", None, logits)
    return logits
