"""Layer functions. Every function takes the array module `xp` first and is pure (no hidden state); the RoPE
scaling functions after rope_angles work on plain numbers (a model's scaling parameters).

Shapes: T new tokens, S = positions seen so far incl. the new ones, D hidden, H query heads, KV kv-heads,
Hd head dim, F feed-forward, V vocab. Every array is float32 unless a comment says otherwise.
Numerics follow ggml's CPU path where it is cheap to do so (RMSNorm sum in float64, root in float32;
softmax sum in float64), so that the reference disagrees with llama.cpp only by summation order.
"""
from __future__ import annotations

import math
import struct

F32 = "float32"


def rms_norm(xp, x, w, eps: float):
    """x: [T, D] f32, w: [D] f32 -> [T, D] f32.  y = x / sqrt(mean(x^2) + eps) * w"""
    ss = xp.sum(x * x, axis=-1, dtype=xp.float64, keepdims=True)       # [T, 1] f64 accumulator, as ggml
    mean = (ss / x.shape[-1]).astype(xp.float32)                       # [T, 1] f32
    scale = xp.float32(1.0) / xp.sqrt(mean + xp.float32(eps))          # [T, 1] f32
    return (x * scale) * w                                             # [T, D] f32


def layer_norm(xp, x, w, b, eps: float):
    """x: [T, D] f32, w, b: [D] f32 -> [T, D] f32.  y = (x - mean(x)) / sqrt(var(x) + eps) * w + b (GPT-2).

    As ggml_norm: the sum and the sum of squares of the centred values in float64, mean and variance
    rounded to float32, the scale 1/sqrtf(var + eps) in float32; then the multiply and the bias add."""
    n = x.shape[-1]
    mean = (xp.sum(x, axis=-1, dtype=xp.float64, keepdims=True) / n).astype(xp.float32)   # [T, 1] f32
    c = x - mean                                                                           # [T, D] f32
    var = (xp.sum(c * c, axis=-1, dtype=xp.float64, keepdims=True) / n).astype(xp.float32)
    scale = xp.float32(1.0) / xp.sqrt(var + xp.float32(eps))                             # [T, 1] f32
    return (c * scale) * w + b                                                             # [T, D] f32


def linear(xp, x, w):
    """x: [T, in] f32, w: [out, in] f32 -> [T, out] f32.

    w may be stored as float16 or bfloat16 (--weight-dtype): it is widened to float32 for the product.
    w may instead be a matrix object with .matmul(x) (numerics="ggml": ggml's quantized CPU product)."""
    if not isinstance(w, xp.ndarray):
        return w.matmul(x)
    if w.dtype != xp.float32:
        w = w.astype(xp.float32)
    return x @ w.T


def rope_angles(xp, n_pos: int, rope_dim: int, base: float, freq_scale: float = 1.0, factors=None, ramp=None):
    """-> cos, sin: [n_pos, rope_dim/2] f32, built once per cache.

    Angle of pair i at position p is freq_scale * (p * base^(-2i/rope_dim)) / factors[i]. ggml builds
    p * base^(-2i/rope_dim) by repeated float32 multiplication (theta *= theta_scale), then divides by the
    pair's frequency factor and multiplies by freq_scale, each in float32; we do the same, so the tables
    match ggml bit for bit up to the cos/sin rounding. ramp: YaRN's [R/2] extrapolation weights r (yarn_ramp):
    the angle is then t * freq_scale * (1 - r) + t * r (ggml's rope_yarn with ext_factor 1).
    """
    theta_scale = xp.float32(base ** (-2.0 / rope_dim))
    theta = xp.arange(n_pos, dtype=xp.float32)                         # [P] f32
    cols = []
    for _ in range(rope_dim // 2):
        cols.append(theta)
        theta = theta * theta_scale                                    # f32 * f32 -> f32
    ang = xp.stack(cols, axis=1)                                       # [P, rope_dim/2] f32
    if factors is not None:
        ang = ang / xp.asarray(factors, dtype=xp.float32)[None, :]
    if ramp is not None:
        r = xp.asarray(ramp, dtype=xp.float32)[None, :]
        ang = (ang * xp.float32(freq_scale)) * (xp.float32(1.0) - r) + ang * r
    elif freq_scale != 1.0:
        ang = ang * xp.float32(freq_scale)
    ang64 = ang.astype(xp.float64)  # cos/sin of the f32 angle, correctly rounded back to f32
    return xp.cos(ang64).astype(xp.float32), xp.sin(ang64).astype(xp.float32)


def rope_magnitude(xp, cos, sin, attn_factor: float):
    """cos, sin: [P, R/2] f32 -> both times attn_factor, in float32 (YaRN's mscale, LongRoPE's attention factor:
    transformers' `cos * attention_scaling`, ggml's `cosf(theta) * mscale`). Q.K then grows by attn_factor^2."""
    if attn_factor == 1.0:
        return cos, sin
    f = xp.float32(attn_factor)
    return cos * f, sin * f


def yarn_ramp(rope_dim: int, base: float, orig_ctx: int, beta_fast: float = 32.0, beta_slow: float = 1.0,
              truncate: bool = True) -> tuple:
    """YaRN's [R/2] extrapolation weights e, one a pair (rope_angles' ramp, with freq_scale = 1 / factor). Pair i
    turns (orig_ctx / wavelength) times over the original context; pairs turning more than beta_fast times keep
    their frequency (e = 1), pairs turning fewer than beta_slow times are divided by the factor (e = 0), and a
    linear ramp over the pair index blends between: inv_freq = inv / factor * (1 - e) + inv * e
    (transformers' _compute_yarn_parameters, ggml's rope_yarn). The ramp's ends are floored and ceiled
    (truncate, transformers' default and ggml_rope_yarn_corr_dims) and clamped to [0, R - 1]; e in float32
    arithmetic, as both compute it."""
    def corr_dim(n_rot):           # the pair dimension that turns n_rot times over orig_ctx positions
        return rope_dim * math.log(orig_ctx / (n_rot * 2 * math.pi)) / (2 * math.log(base))

    low, high = corr_dim(beta_fast), corr_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = _f32(max(low, 0)), _f32(min(high, rope_dim - 1))
    span = _f32(high - low) if high != low else _f32(0.001)
    return tuple(_f32(1.0 - min(1.0, max(0.0, _f32(_f32(i - low) / span)))) for i in range(rope_dim // 2))


def _f32(x: float) -> float:
    """x rounded to float32 (one float32 operation's result, where x is a double's exact-enough value)."""
    return struct.unpack("f", struct.pack("f", x))[0]


def yarn_attn_factor(factor: float, mscale: float | None = None, mscale_all_dim: float | None = None) -> float:
    """YaRN's magnitude correction of cos and sin: 0.1 ln(factor) + 1 (the paper's sqrt(1/t)); with DeepSeek's
    mscale and mscale_all_dim, get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim) (1 where they are
    equal); 1 for factor <= 1."""
    def get_mscale(s, m=1.0):
        return 1.0 if s <= 1 else 0.1 * m * math.log(s) + 1.0

    if mscale and mscale_all_dim:
        return get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
    return get_mscale(factor)


def longrope_attn_factor(factor: float, orig_ctx: int) -> float:
    """LongRoPE's magnitude correction of cos and sin: sqrt(1 + ln(factor) / ln(orig_ctx)); 1 for factor <= 1."""
    return 1.0 if factor <= 1.0 else math.sqrt(1.0 + math.log(factor) / math.log(orig_ctx))


def dynamic_ntk_base(base: float, rope_dim: int, factor: float, orig_ctx: int, seq_len: int) -> float:
    """Dynamic NTK: the RoPE base for a sequence of seq_len positions, base * (factor * s / orig_ctx - (factor -
    1))^(R / (R - 2)) with s = max(seq_len, orig_ctx) (so the base is unchanged up to orig_ctx)."""
    s = max(int(seq_len), int(orig_ctx))
    return base * ((factor * s / orig_ctx) - (factor - 1)) ** (rope_dim / (rope_dim - 2))


def step_rope(seq_len: int, base: float, rope_dim: int, factors=None, factors_long=None, ntk_factor: float = 0.0,
              orig_ctx: int = 0) -> tuple:
    """-> (base, per-pair factors) of a forward step after which the sequence holds seq_len positions, chosen
    as transformers chooses them on every forward call (seq_len = max(position_ids) + 1): LongRoPE takes its
    long factor set once seq_len > orig_ctx and its short set (`factors`) otherwise; dynamic NTK grows the base
    for seq_len > orig_ctx. Every other scaling: (base, factors) whatever the length."""
    if factors_long is not None and seq_len > orig_ctx:
        return base, factors_long
    if ntk_factor and seq_len > orig_ctx:
        return dynamic_ntk_base(base, rope_dim, ntk_factor, orig_ctx, seq_len), factors
    return base, factors


def rope(xp, x, cos, sin, style: str):
    """x: [T, nh, Hd] f32, cos/sin: [T, R/2] f32 (R = rotated dims <= Hd) -> [T, nh, Hd] f32.

    style "adjacent": rotate pairs (2i, 2i+1) (GGUF llama layout, ggml ROPE_TYPE_NORM);
    style "neox": rotate pairs (i, i + R/2) (Hugging Face rotate_half layout).
    """
    r = 2 * cos.shape[-1]
    c, s = cos[:, None, :], sin[:, None, :]                            # [T, 1, R/2]
    out = x.copy()
    if style == "adjacent":
        x0, x1 = x[..., 0:r:2], x[..., 1:r:2]
        out[..., 0:r:2] = x0 * c - x1 * s
        out[..., 1:r:2] = x0 * s + x1 * c
    elif style == "neox":
        x0, x1 = x[..., : r // 2], x[..., r // 2: r]
        out[..., : r // 2] = x0 * c - x1 * s
        out[..., r // 2: r] = x0 * s + x1 * c
    else:
        raise ValueError(f"unknown rope style {style!r}")
    return out


def qkv(xp, x, wq, wk, wv, n_heads: int, n_kv_heads: int, head_dim: int):
    """x: [T, D] -> q: [T, H, Hd], k: [T, KV, Hd], v: [T, KV, Hd] (all f32, before RoPE)."""
    t = x.shape[0]
    q = linear(xp, x, wq).reshape(t, n_heads, head_dim)
    k = linear(xp, x, wk).reshape(t, n_kv_heads, head_dim)
    v = linear(xp, x, wv).reshape(t, n_kv_heads, head_dim)
    return q, k, v


def kv_head_of(xp, n_heads: int, n_kv_heads: int):
    """-> [H] int: the KV head each query head reads (grouped-query attention: h // (H/KV))."""
    return xp.arange(n_heads) // (n_heads // n_kv_heads)


def softmax(xp, s):
    """s: [..., S] f32 (may hold -inf) -> [..., S] f32; sum in float64 like ggml's soft_max."""
    m = xp.max(s, axis=-1, keepdims=True)
    e = xp.exp(s - m)                                                  # f32
    z = xp.sum(e, axis=-1, dtype=xp.float64, keepdims=True)
    return e * (1.0 / z).astype(xp.float32)


def attention_scores(xp, q, k, kv_head):
    """q: [T, H, Hd], k: [S, KV, Hd], kv_head: [H] -> raw scores q.k: [H, T, S] f32 (no scale, no mask)."""
    kh = k[:, kv_head, :]                                              # [S, H, Hd]  (repeat KV heads)
    return xp.matmul(q.transpose(1, 0, 2), kh.transpose(1, 2, 0))      # [H, T, Hd] @ [H, Hd, S]


def attention(xp, q, k, v, mask, scale: float, kv_head):
    """q: [T, H, Hd], k/v: [S, KV, Hd], mask: [T, S] f32 (0 or -inf) -> (out [T, H*Hd], kq, probs [H, T, S])."""
    kq = attention_scores(xp, q, k, kv_head)                          # [H, T, S]
    probs = softmax(xp, kq * xp.float32(scale) + mask)                 # [H, T, S]
    vh = v[:, kv_head, :].transpose(1, 0, 2)                           # [H, S, Hd]
    out = xp.matmul(probs, vh)                                         # [H, T, Hd]
    t = q.shape[0]
    return out.transpose(1, 0, 2).reshape(t, -1), kq, probs            # [T, H*Hd]


def silu(xp, x):
    """x: [...] f32 -> x * sigmoid(x), f32."""
    return x / (xp.float32(1.0) + xp.exp(-x))


GELU_C = 0.7978845608028654       # sqrt(2/pi)
GELU_A = 0.044715


def gelu_tanh(xp, x):
    """x: [...] f32 -> 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), f32 (PyTorch's gelu(approximate="tanh"))."""
    inner = xp.float32(GELU_C) * (x + xp.float32(GELU_A) * x * x * x)
    return xp.float32(0.5) * x * (xp.float32(1.0) + xp.tanh(inner))


def gelu_mlp(xp, x, w_up, b_up, w_down, b_down):
    """x: [T, D] -> (out [T, D], hidden [T, F]) with hidden = gelu_tanh(x Wu^T + b_up), out = hidden Wd^T + b_down
    (GPT-2's MLP: no gate, tanh GELU, biases)."""
    h = gelu_tanh(xp, linear(xp, x, w_up) + b_up)                      # [T, F]
    return linear(xp, h, w_down) + b_down, h


def geglu(xp, x, w_gate, w_up, w_down):
    """x: [T, D] -> (out [T, D], hidden [T, F]) with hidden = gelu_tanh(x Wg^T) * (x Wu^T) (Gemma)."""
    h = gelu_tanh(xp, linear(xp, x, w_gate)) * linear(xp, x, w_up)     # [T, F]
    return linear(xp, h, w_down), h


def swiglu(xp, x, w_gate, w_up, w_down):
    """x: [T, D] -> (out [T, D], hidden [T, F]) with hidden = silu(x Wg^T) * (x Wu^T)."""
    h = silu(xp, linear(xp, x, w_gate)) * linear(xp, x, w_up)          # [T, F]
    return linear(xp, h, w_down), h
