"""Teacher-forced (local) comparison: every layer operation of the reference, run on the subject's own inputs.

For a tensor y = op(x1, x2, ...) of the forward pass, the local error compares the subject's y with the
reference's op applied to the subject's own x's: what this one operation added. The end-to-end error (the
subject's y against the reference's y) is that plus everything it inherited. On quantized weights the
inherited part dominates after a few layers, and a 5% error in one weight matrix hides in it; the local
error does not inherit, so it is named where it starts.

The reference's operations are the engine's own (`engine.ops`, `engine.weights`): `--numerics exact`
(float32 on dequantized weights) or `--numerics ggml` (llama.cpp's activation quantization and summation
order), with the engine's K/V cache type: the arithmetic the subject declares. Inputs and outputs are the
canonical arrays of the dump (the layouts undone by its manifest).

    local_outputs(engine, get, layer, n_tokens) -> {tensor name: the reference op on the subject's inputs}
"""
from __future__ import annotations

import numpy as np

from ..model import forward as fwd
from ..model.attention_chunks import attention_in_chunks
from ..model.cache import visible_mask
from ..numerics.ggml_cpu import flash_attention

# y <- op(inputs): which subject tensors feed each local operation (documentation and the bundle's report)
INPUTS = {
    "attn_norm": ("l_out[L-1] (the embedding at layer 0)",), "q_proj": ("attn_norm",), "k_proj": ("attn_norm",),
    "v": ("attn_norm",), "q_normed": ("q_proj",), "k_normed": ("k_proj",), "q": ("q_proj or q_normed",),
    "k": ("k_proj or k_normed",), "k_cache": ("k",), "v_cache": ("v",), "kq": ("q", "k_cache"),
    "kq_soft_max": ("q", "k_cache"), "kqv_out": ("q", "k_cache", "v_cache"), "attn_out": ("kqv_out (q, k_cache, v_cache when fused)",),
    "attn_post_norm": ("attn_out",), "ffn_inp": ("l_out[L-1]", "attn_out or attn_post_norm"),
    "ffn_norm": ("ffn_inp",), "ffn_swiglu": ("ffn_norm",), "ffn_out": ("ffn_swiglu",),
    "ffn_post_norm": ("ffn_out",), "l_out": ("ffn_inp", "ffn_out or ffn_post_norm"),
    "result_norm": ("l_out[last]",), "logits": ("result_norm",),
}


def layer_window(cfg, layer) -> int:
    """The attention window of a layer: cfg.sliding_window on a local layer, 0 (causal only) on a global one
    and on the head (layer None)."""
    return cfg.sliding_window if layer is not None and cfg.is_local(layer) else 0


def comparison_mask(xp, cfg, layer, positions, n_keys: int):
    """The additive mask [T, S] (0 visible, -inf hidden) of the rows held at absolute `positions` against the
    keys at positions 0..n_keys-1: causal, and inside the window on a local layer (layer_window)."""
    q_pos = xp.asarray(positions)[:, None]
    return visible_mask(xp, q_pos, xp.arange(n_keys)[None, :], layer_window(cfg, layer))


def visible(cfg, layer, positions, n_keys: int) -> np.ndarray:
    """bool [T, S]: the entries of comparison_mask a query sees (the scores an engine must compute)."""
    return np.isfinite(comparison_mask(np, cfg, layer, positions, n_keys))


def embedding(engine, token_ids, positions=None) -> np.ndarray:
    """The reference's embedding rows (layer 0's input): a lookup, exact in every arithmetic; GPT-2 adds the
    position rows of `positions` (default 0..T-1)."""
    cfg, w = engine.config, engine.weights
    x = engine.backend.to_numpy(w.tok_embd[np.asarray(token_ids)]).astype(np.float32)
    x = x * np.float32(cfg.embed_scale) if cfg.embed_scale is not None else x
    if cfg.pos_embd == "learned":
        at = np.arange(len(token_ids)) if positions is None else np.asarray(positions)
        x = x + engine.backend.to_numpy(w.pos_embd)[at]
    return x


def _cache_rows(engine, get, layer: int, name: str, new, positions, cache):
    """The layer's cached rows [S, KV, Hd] (float32) as the reference op leaves them: the subject's own rows
    (its k_cache/v_cache), with the rows at `positions` replaced by the new ones stored in the cache's type
    (f16 rounds here). Without the subject's cache: the new rows alone (a forward from position 0)."""
    xp, asx = engine.xp, engine.backend.asarray
    held = get(name, layer)
    stored = new.astype(cache.k.dtype)
    if held is None:
        return stored.astype(xp.float32)
    rows = asx(held).astype(cache.k.dtype)
    rows[asx(positions)] = stored
    return rows.astype(xp.float32)


def attention_by_batch(engine, q, k, v, mask, kv_head, one_token=None, cells=None, keep=None):
    """engine.ops.attention on the rows held, each by the product llama.cpp used for it: a row computed in a
    micro-batch of one token (one_token[i]) by its vec_dot, every other row by the tiles of a batch (tinyBLAS),
    as the rows' own micro-batches chose (ggml numerics; the rows are independent given the cache, so only
    the kind of product matters). one_token None: all rows as one batch of the rows held. cells: the cache
    cell of each position (a sequence sharing its cache with others in one batch): the keys are then placed
    at their cells, the others hidden, so the sums of the softmax and of P.V run over the lanes llama.cpp's
    did (a hidden key adds an exact 0), and kq and probs are taken back at the positions. keep: the rows (indices
    into the rows held) whose kq and probs come back (default all): a long prompt's rows held as one batch then
    run in query-row chunks (model/attention_chunks.py: the same bits), its H x T x S scores never whole."""
    ops, xp, cfg = engine.ops, engine.xp, engine.config
    s = k.shape[0]
    if cells is not None and list(cells[:s]) != list(range(s)):
        at = xp.asarray(list(cells[:s]))
        n = int(max(cells[:s])) + 1
        kc, vc = (xp.zeros((n,) + a.shape[1:], dtype=a.dtype) for a in (k, v))
        kc[at], vc[at] = k, v
        mc = xp.full((mask.shape[0], n), -xp.inf, dtype=mask.dtype)
        mc[:, at] = mask
        att, kq, probs = attention_by_batch(engine, q, kc, vc, mc, kv_head, one_token, keep=keep)
        return att, kq[..., at], probs[..., at]
    t = q.shape[0]
    if one_token is None or len(set(one_token)) == 1 and bool(one_token[0]) == (t == 1):
        if keep is None:
            return ops.attention(xp, q, k, v, mask, cfg.scale, kv_head)
        return attention_in_chunks(xp, ops.attention, q, k, v, mask, cfg.scale, kv_head, keep=list(keep))
    groups = [[i] for i in range(t) if one_token[i]] + [[i for i in range(t) if not one_token[i]]]
    att = kq = probs = None
    for rows in (g for g in groups if g):
        sel = rows * 2 if len(rows) == 1 and not one_token[rows[0]] else rows    # a batch's row: t >= 2
        ix = xp.asarray(sel)
        a, sc, p = ops.attention(xp, q[ix], k, v, mask[ix], cfg.scale, kv_head)
        if att is None:
            att = xp.zeros((t,) + a.shape[1:], dtype=a.dtype)
            kq, probs = (xp.zeros(x.shape[:1] + (t,) + x.shape[2:], dtype=x.dtype) for x in (sc, p))
        n, dst = len(rows), xp.asarray(rows)
        att[dst], kq[:, dst], probs[:, dst] = a[:n], sc[:, :n], p[:, :n]
    if keep is not None:
        sel = xp.asarray(list(keep))
        return att, kq[:, sel], probs[:, sel]
    return att, kq, probs


def local_outputs(engine, get, layer: int, token_ids, fused_attention: bool = False, past: int = 0,
                  positions=None, only=None, one_token=None, cells=None, score_rows=None) -> dict:
    """get(name, layer) -> the subject's canonical array or None. -> {name: reference op on the subject's
    inputs} for every tensor of this layer whose inputs the subject holds. fused_attention: the subject ran
    llama.cpp's flash attention (ggml numerics, F16 cache): attn_out is then checked through its emulation.
    past: positions already in the subject's cache (a decode step): the new tokens sit at past... positions:
    the absolute position of each row held (default past.., every row; a dump of chosen rows holds fewer).
    The cache rows not written by these rows are the subject's own (its k_cache/v_cache), so only the rows
    written are checked. only: the names to compute (default every one whose inputs are held): a repro runs
    one operation. one_token: per row held, whether the subject computed it in a micro-batch of one token
    (attention_by_batch; default: the rows held as one batch). cells: the cache cell of each position, where
    the subject's sequence shared its cache (attention_by_batch; default: cell = position). score_rows: the rows
    (indices into the rows held) whose kq and kq_soft_max are computed (a long prompt's dump holds its scores at
    sampled rows; default every row)."""
    cfg, ops, xp = engine.config, engine.ops, engine.xp
    lw = engine.weights.layers[layer]
    t = len(token_ids)
    positions = np.arange(past, past + t) if positions is None else np.asarray(positions)
    out = {}
    asx = engine.backend.asarray
    npy = engine.backend.to_numpy

    def want(*outs):
        return only is None or any(o in only for o in outs)

    def have(*names):
        vals = [get(n, layer) if isinstance(n, str) else n for n in names]
        return None if any(v is None for v in vals) else [asx(v) for v in vals]

    x_in = None
    if want("attn_norm", "ffn_inp"):
        x_in = embedding(engine, token_ids, positions) if layer == 0 else get("l_out", layer - 1)
    if x_in is not None and want("attn_norm"):
        out["attn_norm"] = fwd.norm(xp, cfg, ops, asx(x_in), lw, "attn_norm")
    if want("q_proj", "k_proj", "v") and (a := have("attn_norm")) is not None:
        q, k, v = ops.qkv(xp, a[0], lw.wq, lw.wk, lw.wv, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim)
        if cfg.qkv_bias:
            q, k, v = (q + lw.bq.reshape(q.shape[1:]), k + lw.bk.reshape(k.shape[1:]), v + lw.bv.reshape(v.shape[1:]))
        out.update(q_proj=q, k_proj=k, v=v)
    if cfg.qk_norm:
        if want("q_normed") and (a := have("q_proj")) is not None:
            out["q_normed"] = ops.rms_norm(xp, a[0], lw.q_norm, cfg.rms_eps)
        if want("k_normed") and (a := have("k_proj")) is not None:
            out["k_normed"] = ops.rms_norm(xp, a[0], lw.k_norm, cfg.rms_eps)
    cache = engine.new_cache()
    local = cfg.is_local(layer)
    qn, kn = ("q", "k") if cfg.uses_rope else ("q_proj", "k_proj")        # GPT-2: no RoPE, Q and K as projected
    if cfg.uses_rope:
        seq_len = max(past + t, int(np.max(positions)) + 1)                  # LongRoPE's set, dynamic NTK's base
        cos, sin = (tab[asx(positions)] for tab in cache.tables(local, seq_len))
        for name, src in (("q", "q_normed" if cfg.qk_norm else "q_proj"), ("k", "k_normed" if cfg.qk_norm else "k_proj")):
            if want(name) and (a := have(src)) is not None:
                out[name] = ops.rope(xp, a[0], cos, sin, cfg.rope_style)
    if want("k_cache", "v_cache") and (a := have(kn, "v")) is not None:
        out.update(k_cache=_cache_rows(engine, get, layer, "k_cache", a[0], positions, cache),
                   v_cache=_cache_rows(engine, get, layer, "v_cache", a[1], positions, cache))
    mask = None
    fused = want("attn_out") and get("kqv_out", layer) is None          # attn_out from q, k, v (flash attention)
    if (want("kq", "kq_soft_max", "kqv_out") or fused) and (a := have(qn, "k_cache", "v_cache")) is not None:
        kv_head = ops.kv_head_of(xp, cfg.n_heads, cfg.n_kv_heads)
        mask = comparison_mask(xp, cfg, layer, asx(positions), a[1].shape[0])
        att, kq, probs = attention_by_batch(engine, a[0], a[1], a[2], mask, kv_head, one_token, cells, score_rows)
        out.update(kq=kq, kq_soft_max=probs, kqv_out=att)
    if not want("attn_out"):
        pass
    elif (a := have("kqv_out")) is not None:
        out["attn_out"] = fwd.out_proj(xp, cfg, ops, lw, a[0])
    elif "kqv_out" in out:                  # a fused attention (flash attention): attn_out from q, k, v
        att = out["kqv_out"]
        if fused_attention and engine.numerics == "ggml":
            a = have(qn, "k_cache", "v_cache")
            att = flash_attention(xp, a[0], a[1], a[2], mask, cfg.scale, ops.kv_head_of(xp, cfg.n_heads, cfg.n_kv_heads))
        out["attn_out"] = fwd.out_proj(xp, cfg, ops, lw, att)
    if cfg.post_norms and want("attn_post_norm") and (a := have("attn_out")) is not None:
        out["attn_post_norm"] = ops.rms_norm(xp, a[0], lw.post_attn_norm, cfg.rms_eps)
    if x_in is not None and want("ffn_inp") and (a := have("attn_post_norm" if cfg.post_norms else "attn_out")) is not None \
            and a[0].shape == x_in.shape:
        out["ffn_inp"] = asx(x_in) + a[0]
    if want("ffn_norm") and (a := have("ffn_inp")) is not None:
        out["ffn_norm"] = fwd.norm(xp, cfg, ops, a[0], lw, "ffn_norm")
    if want("ffn_swiglu") and (a := have("ffn_norm")) is not None:
        if cfg.ffn_gated:
            glu = ops.swiglu if cfg.ffn_act == "silu" else ops.geglu
            out["ffn_swiglu"] = glu(xp, a[0], lw.w_gate, lw.w_up, lw.w_down)[1]
        else:                                                            # GPT-2's MLP: up + bias, GELU
            out["ffn_swiglu"] = ops.gelu_mlp(xp, a[0], lw.w_up, lw.b_up, lw.w_down, lw.b_down)[1]
    if want("ffn_out") and (a := have("ffn_swiglu")) is not None:
        out["ffn_out"] = ops.linear(xp, a[0], lw.w_down)
        if cfg.linear_bias:
            out["ffn_out"] = out["ffn_out"] + lw.b_down
    if cfg.post_norms and want("ffn_post_norm") and (a := have("ffn_out")) is not None:
        out["ffn_post_norm"] = ops.rms_norm(xp, a[0], lw.post_ffn_norm, cfg.rms_eps)
    if want("l_out") and (a := have("ffn_inp", "ffn_post_norm" if cfg.post_norms else "ffn_out")) is not None \
            and a[0].shape == a[1].shape:
        out["l_out"] = a[0] + a[1]
    return {k: npy(v) for k, v in out.items()}


def last_row(get):
    """get, its tensors cut to their last row: checkpoint 9's logits are computed on that row alone, as
    generation asks for them (llama.cpp then multiplies one row by ggml's vec_dot, not tinyBLAS's tiles)."""
    def get_last(name, layer):
        a = get(name, layer)
        return None if a is None else a[-1:]
    return get_last


def model_outputs(engine, get, only=None) -> dict:
    """The head: result_norm from the last layer's l_out, logits from result_norm (the subject's own)."""
    cfg, ops, xp, w = engine.config, engine.ops, engine.xp, engine.weights
    asx = engine.backend.asarray
    out = {}
    x = get("l_out", cfg.n_layers - 1) if only is None or "result_norm" in only else None
    if x is not None:
        out["result_norm"] = fwd.norm(xp, cfg, ops, asx(x), w, "out_norm")
    h = get("result_norm", None) if only is None or "logits" in only else None
    if h is not None:
        out["logits"] = ops.linear(xp, asx(h), w.output)
    return {k: engine.backend.to_numpy(v) for k, v in out.items()}
