"""block() and forward(): the whole model as the plain sequence of layer functions over `ops`, the oracle.

The recorder is an observer: `record(name, layer, array)` is called with every checkpoint tensor (layer None
outside the blocks). The pieces (embed, project_qkv, feed_forward, head) are the same steps a backend's own
forward composes (backends/fused_forward.py); nothing here asks which backend runs it.
"""
from __future__ import annotations

from . import layers as L
from .attention_chunks import row_spans

NORM_OF = {"attn_post_norm": "post_attn_norm", "ffn_post_norm": "post_ffn_norm"}   # checkpoint -> its weight


def _noop(name, layer, arr):
    pass


def embed(xp, cfg, w, tokens, pos0=0):
    """tokens: [T] int at positions pos0.. -> the token embeddings [T] f32 ([T, D]), scaled by sqrt(D) for Gemma,
    plus the learned position rows for GPT-2."""
    x = w.tok_embd[xp.asarray(tokens)].astype(xp.float32, copy=False)                  # [T, D]
    if cfg.embed_scale is not None:                                                      # Gemma: x sqrt(D)
        x = x * xp.float32(cfg.embed_scale)
    if cfg.pos_embd == "learned":                                                        # GPT-2: + wpe[p]
        x = x + w.pos_embd[pos0:pos0 + len(tokens)]
    return x


def norm(xp, cfg, ops, x, owner, name):
    """x: [T, D] -> the norm by owner's weight `name`: RMSNorm, or LayerNorm with the bias `name`_b (GPT-2)."""
    if cfg.norm == "layer":
        return ops.layer_norm(xp, x, getattr(owner, name), getattr(owner, name + "_b"), cfg.rms_eps)
    return ops.rms_norm(xp, x, getattr(owner, name), cfg.rms_eps)


def out_proj(xp, cfg, ops, lw, att):
    """att: [T, H*Hd] -> [T, D]: the output projection, plus its bias where the model has one (GPT-2)."""
    out = ops.linear(xp, att, lw.wo)
    return out + lw.bo if cfg.linear_bias else out


def project_qkv(xp, cfg, ops, lw, h, layer, record=_noop):
    """h: [T, D] normed -> (q [T, H, Hd], k [T, KV, Hd], v [T, KV, Hd]) before RoPE: the products, their biases
    (Qwen2) and the per-head norms (Gemma 3)."""
    q, k, v = ops.qkv(xp, h, lw.wq, lw.wk, lw.wv, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim)
    if cfg.qkv_bias:                                                                     # Qwen2
        q, k, v = (q + lw.bq.reshape(q.shape[1:]), k + lw.bk.reshape(k.shape[1:]), v + lw.bv.reshape(v.shape[1:]))
    record("q_proj", layer, q); record("k_proj", layer, k); record("v", layer, v)
    if cfg.qk_norm:                                                                      # Gemma 3: per head, over Hd
        q = ops.rms_norm(xp, q, lw.q_norm, cfg.rms_eps)                                  # [T, H, Hd]
        k = ops.rms_norm(xp, k, lw.k_norm, cfg.rms_eps)                                  # [T, KV, Hd]
        record("q_normed", layer, q); record("k_normed", layer, k)
    return q, k, v


def rope_store_attend(xp, cfg, ops, q, k, v, cache, layer, record=_noop):
    """RoPE, the cache write and attention, one operation at a time (each a checkpoint) -> [T, H*Hd]. The mask
    is asked for after the write (a cache may build it from what it holds)."""
    local = cfg.is_local(layer)
    kv_head = ops.kv_head_of(xp, cfg.n_heads, cfg.n_kv_heads)
    if cfg.uses_rope:                                                                    # GPT-2: positions learned
        cos, sin = cache.rope_rows(q.shape[0], local)                                    # [T, R/2]
        q = ops.rope(xp, q, cos, sin, cfg.rope_style)                                    # [T, H, Hd]
        k = ops.rope(xp, k, cos, sin, cfg.rope_style)                                    # [T, KV, Hd]
        record("q", layer, q); record("k", layer, k)
    k_all, v_all = cache.store(layer, k, v)                                              # [S, KV, Hd]
    record("k_cache", layer, k_all); record("v_cache", layer, v_all)
    mask = cache.mask(q.shape[0], cfg.sliding_window if local else 0)                    # [T, S]
    att, kq, probs = ops.attention(xp, q, k_all, v_all, mask, cfg.scale, kv_head)        # [T, H*Hd]
    record("kq", layer, kq); record("kq_soft_max", layer, probs); record("kqv_out", layer, att)
    return att


def post_norm(xp, cfg, ops, lw, a, name, layer, record=_noop):
    """a, or its RMSNorm by lw's weight `name` where the architecture norms a sublayer's output before the
    residual add (Gemma 3: attn_post_norm, ffn_post_norm; the weight read only then)."""
    if not cfg.post_norms:
        return a
    a = ops.rms_norm(xp, a, getattr(lw, NORM_OF[name]), cfg.rms_eps)
    record(name, layer, a)
    return a


def feed_forward(xp, cfg, ops, lw, h, layer, record=_noop):
    """h: [T, D] normed -> the FFN's output [T, D] (gated SiLU or GELU, or GPT-2's ungated GELU MLP with biases;
    then the post-FFN norm where there is one)."""
    if cfg.ffn_gated:
        glu = ops.swiglu if cfg.ffn_act == "silu" else ops.geglu
        ffn, hidden = glu(xp, h, lw.w_gate, lw.w_up, lw.w_down)                          # [T, D], [T, F]
    else:
        ffn, hidden = ops.gelu_mlp(xp, h, lw.w_up, lw.b_up, lw.w_down, lw.b_down)        # [T, D], [T, F]
    record("ffn_swiglu", layer, hidden); record("ffn_out", layer, ffn)
    return post_norm(xp, cfg, ops, lw, ffn, "ffn_post_norm", layer, record)


def block(xp, cfg, lw, x, cache, layer: int, record=_noop, ops=L, out_rows=None):
    """x: [T, D] f32 -> the block's output [T, D] f32, or [R, D] with out_rows (one block; writes this layer's K/V).

    ops: the namespace of layer functions (default: model.layers, the reference; numerics="ggml" passes
    llama.cpp's CPU kernels). out_rows: keep only these rows after attention, as llama.cpp does in
    its last layer (the FFN then runs on the rows whose logits are wanted).
    Architecture switches (Config): qkv_bias (Qwen2); qk_norm, post_norms, ffn_act, local layers (Gemma 3);
    norm, pos_embd, ffn_gated, linear_bias (GPT-2)."""
    h = norm(xp, cfg, ops, x, lw, "attn_norm")                                           # [T, D]
    record("attn_norm", layer, h)
    q, k, v = project_qkv(xp, cfg, ops, lw, h, layer, record)
    att = rope_store_attend(xp, cfg, ops, q, k, v, cache, layer, record)
    att = out_proj(xp, cfg, ops, lw, att)                                                # [T, D]
    record("attn_out", layer, att)
    if out_rows is not None:
        att, x = att[out_rows], x[out_rows]                                              # [R, D]
    att = post_norm(xp, cfg, ops, lw, att, "attn_post_norm", layer, record)
    x = x + att
    h = norm(xp, cfg, ops, x, lw, "ffn_norm")
    record("ffn_inp", layer, x); record("ffn_norm", layer, h)
    x = x + feed_forward(xp, cfg, ops, lw, h, layer, record)
    record("l_out", layer, x)
    return x


def head(xp, cfg, ops, w, x, record=_noop, logits_sink=None):
    """x: [R, D], the last block's output -> logits [R, V]: the final norm and the output matrix. logits_sink:
    see forward (the logits handed over a span of rows at a time, the last row's returned)."""
    x = norm(xp, cfg, ops, x, w, "out_norm")
    record("result_norm", None, x)
    if logits_sink is not None:
        return head_in_spans(xp, ops, w, x, logits_sink)
    logits = ops.linear(xp, x, w.output)                                                 # [R, V]
    record("result_output", None, logits)
    return logits


LOGIT_SPAN = 256           # rows of the output product per span where the logits go to a sink


def head_in_spans(xp, ops, w, x, sink, span: int = LOGIT_SPAN):
    """The output product of the normed rows x [R, D] a span of rows at a time (at least 64 rows each: the same
    values as one product, tests/test_long_memory.py), each handed to sink(first row, logits [n, V]) -> the
    last row's logits [1, V]."""
    last = None
    for a, b in row_spans(x.shape[0], span):
        part = ops.linear(xp, x[a:b], w.output)                                          # [n, V]
        sink(a, part)
        last = part[-1:]
        del part
    return xp.array(last, copy=True)


def forward(xp, cfg, w, tokens, cache, rows=None, record=_noop, ops=L, logits_sink=None):
    """tokens: [T] int -> logits [R, V] f32 for `rows` (indices into the T new tokens; None = all).

    Appends the T tokens to the sequence held by `cache` (positions cache.pos .. cache.pos+T-1).
    logits_sink(first row, logits [n, V]): a long prompt's logits handed over a span of rows at a time instead
    (never [R, V] at once; result_output is then not recorded: the sink holds it), and the last row's [1, V]
    returned.
    """
    t = len(tokens)
    cache.check_room(t)
    x = embed(xp, cfg, w, tokens, cache.pos)
    record("embd", None, x)
    last = len(w.layers) - 1
    out_rows = None if rows is None else xp.asarray(rows)
    for i, lw in enumerate(w.layers):
        x = block(xp, cfg, lw, x, cache, i, record, ops, out_rows if i == last else None)
    cache.advance(t)
    return head(xp, cfg, ops, w, x, record, logits_sink)
