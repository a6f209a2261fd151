"""Layer functions. Every function takes the array module `xp` first and is pure (no hidden state).

Shapes: T new tokens, S = positions seen so far incl. the new ones, D hidden, H query heads, KV kv-heads,
Hd head dim, F feed-forward, V vocab. Every array is float32 unless a comment says otherwise.
Numerics follow ggml's CPU path where it is cheap to do so (RMSNorm sum in float64, root in float32;
softmax sum in float64), so that the reference disagrees with llama.cpp only by summation order.
"""
from __future__ import annotations

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


def rope_angles(xp, n_pos: int, rope_dim: int, base: float, freq_scale: float = 1.0, factors=None):
    """-> cos, sin: [n_pos, rope_dim/2] f32, built once per cache.

    Angle of pair i at position p is freq_scale * (p * base^(-2i/rope_dim)) / factors[i]. ggml builds
    p * base^(-2i/rope_dim) by repeated float32 multiplication (theta *= theta_scale), then divides by the
    pair's frequency factor and multiplies by freq_scale, each in float32; we do the same, so the tables
    match ggml bit for bit up to the cos/sin rounding.
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
    if freq_scale != 1.0:
        ang = ang * xp.float32(freq_scale)
    ang64 = ang.astype(xp.float64)  # cos/sin of the f32 angle, correctly rounded back to f32
    return xp.cos(ang64).astype(xp.float32), xp.sin(ang64).astype(xp.float32)


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
