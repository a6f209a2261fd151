"""ggml's CPU matrix products, reproduced in NumPy (x86 builds of llama.cpp with llamafile sgemm: AVX2 or AVX-512).

What llama.cpp computes for y = x @ W^T on the CPU, and what this module reproduces:

- Activations are converted to the weight's `vec_dot_type` first: Q8_0 for Q4_0/Q5_0/Q8_0 weights,
  Q8_1 for Q4_1/Q5_1, float16 for F16 weights, unchanged for F32. Q8 quantization per block of 32:
  d = amax/127 (stored as f16), q = round-half-even(x * 127/amax) (AVX `_mm256_round_ps`), and for Q8_1
  s = d * sum(q) (stored as f16).
- Each output is one dot product with 8 float32 lanes: per 32-element block, lane l holds the exact
  integer sum of elements 4l..4l+3 (for float types: element k goes to lane k % 8 of an 8-wide FMA
  accumulator), accumulated with fused multiply-add `acc = fma(d_w * d_x, lane_sum, acc)` block after
  block; then the lanes are summed as ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7)). Q4_1/Q5_1 add
  sum_b m_w * s_x, accumulated in float32, at the end.

FMA is emulated in float64 (a*b of two float32 values is exact in float64; the sum is rounded to float32).
All results are float32. Verified bit for bit against llama.cpp's captured tensors for Q4_1 and Q8_0
(tests/test_ggml_numerics.py).

The float sums depend on the build's vector width (`lanes`: 8 for AVX2, 16 for AVX-512; SIMD_LANES names them):
tinyBLAS's F32/F16 products keep `lanes` FMA lanes over K and sum them at the end (hsum); ggml_vec_dot_f32/f16 keep
4 accumulators of `lanes` over steps of 4 * lanes; the softmax sums exps in chunks of `lanes`; and an AVX-512
build's ggml_v_expf rounds differently from the AVX2 one (v_expf). The integer products of the quantized types
(above, and the K-quants below) are exact whatever the width, and their float steps are the AVX2 code in both builds.
"""
from __future__ import annotations

import numpy as np

from ..errors import UnsupportedModelError
from ..model import layers

F32, F64, F16 = np.float32, np.float64, np.float16
QK = 32


SIMD_LANES = {"avx2": 8, "avx512": 16}          # float32 lanes of a build's vectors (GGML_F32_EPR, tinyBLAS KN)


def hsum8(acc):
    """acc: [..., 8] f32 -> [...] f32, in the order of ggml's hsum_float_8 / tinyBLAS hsum."""
    r = acc[..., 4:] + acc[..., :4]                 # [..., 4]: lane i + lane i+4
    r = r[..., :2] + r[..., 2:]                     # [..., 2]: (0+2), (1+3)
    return r[..., 0] + r[..., 1]


def hsum(acc):
    """acc: [..., 8 or 16] f32 -> [...]: tinyBLAS's hsum; for 16 lanes _mm512_reduce_add_ps, which adds the two
    halves first and then goes on as hsum8."""
    return hsum8(acc[..., :8] + acc[..., 8:]) if acc.shape[-1] == 16 else hsum8(acc)


def fma(a, b, c):
    """float32 fused multiply-add, emulated in float64 (b and c, float32, widened exactly by the ufuncs)."""
    return (a.astype(F64) * b + c).astype(F32)


# -- activation quantization ------------------------------------------------------------------------
def quantize_q8(x, with_sum: bool):
    """x: [T, K] f32 -> q [T, B, 32] int8-valued f32, d [T, B] f32 (from f16), s [T, B] f32 (from f16) or None."""
    t, k = x.shape
    if k % QK:
        raise ValueError(f"row length {k} is not a multiple of {QK}")
    xb = x.reshape(t, k // QK, QK).astype(F32)
    amax = np.abs(xb).max(axis=-1)                                   # [T, B]
    d = amax / F32(127)                                              # f32
    with np.errstate(divide="ignore"):
        inv = np.where(amax != 0, F32(127) / amax, F32(0)).astype(F32)
    q = np.rint(xb * inv[..., None]).astype(F32)                     # round half to even, like _MM_ROUND_NEAREST
    d16 = d.astype(F16).astype(F32)
    s16 = (d * q.sum(axis=-1, dtype=F32)).astype(F16).astype(F32) if with_sum else None
    return q, d16, s16


# -- weight blocks ------------------------------------------------------------------------------------
def f16_at(raw, lo):
    """The float16 stored at byte offset lo of each block (a scale), as float32."""
    return np.ascontiguousarray(raw[..., lo:lo + 2]).view(F16)[..., 0].astype(F32)


def _nibbles(qs):
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.int16)        # natural element order


def _high_bits(qh_bytes):
    qh = np.ascontiguousarray(qh_bytes).view(np.uint32)[..., 0]
    return ((qh[..., None] >> np.arange(32, dtype=np.uint32)) & 1).astype(np.int16)


def unpack_blocks(raw, qtype: str):
    """raw: [N, B*bytes_per_block] uint8 -> (q [N, B, 32] int16 values, d [N, B] f32, m [N, B] f32 or None)."""
    sizes = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q8_0": 34}
    if qtype not in sizes:
        raise NotImplementedError(qtype)
    n = raw.shape[0]
    blk = np.asarray(raw).reshape(n, -1, sizes[qtype])
    if qtype == "Q4_0":
        return _nibbles(blk[..., 2:18]) - 8, f16_at(blk, 0), None
    if qtype == "Q4_1":
        return _nibbles(blk[..., 4:20]), f16_at(blk, 0), f16_at(blk, 2)
    if qtype == "Q5_0":
        return _nibbles(blk[..., 6:22]) + (_high_bits(blk[..., 2:6]) << 4) - 16, f16_at(blk, 0), None
    if qtype == "Q5_1":
        return _nibbles(blk[..., 8:24]) + (_high_bits(blk[..., 4:8]) << 4), f16_at(blk, 0), f16_at(blk, 2)
    return blk[..., 2:34].view(np.int8).astype(np.int16), f16_at(blk, 0), None


ACT_TYPE = {"Q4_0": "Q8_0", "Q5_0": "Q8_0", "Q8_0": "Q8_0", "Q4_1": "Q8_1", "Q5_1": "Q8_1"}


class SpanProduct:
    """A quantized weight's float32 product run a span of activation rows at a time (its temporaries bounded):
    a subclass gives _matmul(x) of one span [S, K] f32 and ROWS, the span's default length."""

    ROWS = 16

    @property
    def dtype(self):
        return np.dtype(F32)

    def matmul(self, x, rows_per_chunk=None):
        """x: [T, K] -> [T, N] f32."""
        n = rows_per_chunk or self.ROWS
        out = np.empty((x.shape[0], self.shape[0]), dtype=F32)
        for i in range(0, x.shape[0], n):
            out[i:i + n] = self._matmul(np.asarray(x[i:i + n], dtype=F32))
        return out


class LegacyQuantMatrix(SpanProduct):
    """A Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 weight [N, K] from its QTensor; matmul(x) reproduces ggml's CPU product."""

    ROWS = 64

    def __init__(self, qt):
        self.qtype, self.shape, self.qt = qt.qtype, tuple(qt.shape), qt
        self._unpacked = None            # unpacked on the first product: a backend with its own kernel never does

    def _lanes(self):
        """-> q_lanes [B, 8, 4, N] (per block and lane, the 4 weights of that lane, ready for batched matmuls),
        d, m [N, B] f32 (m None for types without a min)."""
        if self._unpacked is None:
            q, d, m = unpack_blocks(self.qt.blocks, self.qtype)
            n, b, _ = q.shape
            self._unpacked = (np.ascontiguousarray(q.reshape(n, b, 8, 4).transpose(1, 2, 3, 0).astype(F32)), d, m)
        return self._unpacked

    def _matmul(self, x):
        qa, da, sa = quantize_q8(x, with_sum=ACT_TYPE[self.qtype] == "Q8_1")
        q_lanes, dw, mw = self._lanes()
        t, b, _ = qa.shape
        n = self.shape[0]
        qa_lanes = qa.reshape(t, b, 8, 4).transpose(1, 2, 0, 3)                   # [B, 8, T, 4]
        acc = np.zeros((8, t, n), dtype=F32)                                       # lanes first, as the products
        summs = np.zeros((t, n), dtype=F32) if mw is not None else None
        for blk in range(b):
            lane = np.matmul(qa_lanes[blk], q_lanes[blk])                          # [8, T, N] exact integers
            d0d1 = dw[None, :, blk] * da[:, blk, None]                             # [T, N] f32
            acc = fma(d0d1, lane, acc)
            if summs is not None:
                summs = summs + mw[None, :, blk] * sa[:, blk, None]                # f32
        y = hsum8(np.moveaxis(acc, 0, -1))
        return y + summs if summs is not None else y


class FloatMatrix:
    """An F32 or F16 weight [N, K]; matmul(x) reproduces llamafile's tinyBLAS product (`lanes`-lane FMA over K),
    or ggml_vec_dot_f32/f16 when x has a single row (llama.cpp does not use tinyBLAS for one row), K is not a
    multiple of the lanes or N not a multiple of 4 (tinyBLAS declines both)."""

    def __init__(self, w, qtype: str, lanes: int = 8):
        self.qtype, self.shape, self.lanes = qtype, w.shape, lanes
        self.w = np.asarray(w, dtype=F32)                                # F16 values are exact in f32

    @property
    def dtype(self):
        return np.dtype(F32)

    def rows(self, lo: int, hi: int) -> "FloatMatrix":
        """Rows lo..hi as their own matrix (a fused projection's part: each output is its row's own dot product)."""
        return FloatMatrix(self.w[lo:hi], self.qtype, self.lanes)

    def matmul(self, x, rows_per_chunk=16):
        x = np.asarray(x, dtype=F32)
        if self.qtype == "F16":
            x = x.astype(F16).astype(F32)                                # activations rounded to f16
        n, k = self.shape
        lanes = self.lanes
        out = np.empty((x.shape[0], n), dtype=F32)
        if x.shape[0] == 1 or k % lanes or n % 4:  # ggml's own vec_dot: tinyBLAS declines these (rows % 4: its tiles)
            for i in range(0, x.shape[0], rows_per_chunk):
                out[i:i + rows_per_chunk] = _vec_dot_f32(x[i:i + rows_per_chunk, None, :], self.w[None, :, :],
                                                         leftovers_f64=self.qtype == "F16", lanes=lanes)
            return out
        wl = self.w.reshape(n, k // lanes, lanes)
        for i in range(0, x.shape[0], rows_per_chunk):
            xl = x[i:i + rows_per_chunk].reshape(-1, k // lanes, lanes)
            acc = np.zeros((xl.shape[0], n, lanes), dtype=F32)
            for c in range(k // lanes):
                acc = fma(xl[:, None, c, :], wl[None, :, c, :], acc)
            out[i:i + rows_per_chunk] = hsum(acc)
        return out


# -- elementwise and attention kernels ------------------------------------------------------------------
def _hexf(s):
    return F32(float.fromhex(s))


_EXP = {k: _hexf(v) for k, v in dict(r="0x1.8p23", log2e="0x1.715476p+0", ln2hi="0x1.62e4p-1",
                                     ln2lo="0x1.7f7d1cp-20", c0="0x1.0e4020p-7", c1="0x1.573e2ep-5",
                                     c2="0x1.555e66p-3", c3="0x1.fffdb6p-2", c4="0x1.ffffecp-1").items()}


def v_expf(x, lanes: int = 8):
    """ggml_v_expf (AVX2+FMA; lanes 16: the AVX-512 one): exp with max error 1.45 + 0.5 ulp, the one ggml's
    softmax and SiLU use."""
    c = _EXP
    x = np.asarray(x, dtype=F32)
    if lanes == 16:
        return _v_expf_avx512(x)
    with np.errstate(invalid="ignore", over="ignore"):
        z = fma(x, c["log2e"], c["r"])
        n = (z - c["r"]).astype(F32)
        b = fma(-n, c["ln2lo"], fma(-n, c["ln2hi"], x))
        e = z.view(np.int32) << 23
        k = (e + np.array(1.0, F32).view(np.int32)).view(F32)
        big = np.abs(n) > F32(126)
        u = (b * b).astype(F32)
        j = fma(fma(fma(c["c0"], b, c["c1"]), u, fma(c["c2"], b, c["c3"])), u, (c["c4"] * b).astype(F32))
        res = fma(j, k, k)
        if big.any():
            g = np.where(n <= 0, np.int32(-0x7E000000), np.int32(0))                # 0x82000000
            s1 = (g + np.int32(0x7F000000)).view(F32)
            s2 = (e - g).view(F32)
            alt = np.where(np.abs(n) > F32(192), (s1 * s1).astype(F32), (fma(s2, j, s2) * s1).astype(F32))
            res = np.where(big, alt, res)
    return res


def _v_expf_avx512(x):
    """ggml_v_expf's AVX-512 form: the polynomial's last term is fma(c4, b, 1) (AVX2: c4 * b, then fma(j, k, k)),
    scaled by 2^n with _mm512_scalef_ps (exact, one rounding: emulated in float64); |n| > 192 gives inf or 0."""
    c = _EXP
    with np.errstate(invalid="ignore", over="ignore"):
        z = fma(x, c["log2e"], c["r"])
        n = (z - c["r"]).astype(F32)
        b = fma(-n, c["ln2lo"], fma(-n, c["ln2hi"], x))
        u = (b * b).astype(F32)
        j = fma(fma(fma(c["c0"], b, c["c1"]), u, fma(c["c2"], b, c["c3"])), u, fma(c["c4"], b, F32(1)))
        res = (j.astype(F64) * np.exp2(np.clip(n, -193, 193).astype(F64))).astype(F32)
        return np.where(np.abs(n) > F32(192), np.where(n <= 0, F32(0), F32(np.inf)), res).astype(F32)


def rms_norm(xp, x, w, eps: float):
    """ggml's rms_norm then mul: x [..., D] f32 -> x * (1/sqrtf(mean + eps)) * w, the squares (float32) summed in
    float64 in order (ggml_compute_forward_rms_norm_f32's loop; NumPy's own sum is pairwise)."""
    ss = np.cumsum(x * x, axis=-1, dtype=F64)[..., -1:]
    scale = F32(1) / np.sqrt((ss / x.shape[-1]).astype(F32) + F32(eps))
    return (x * scale) * w


def layer_norm(xp, x, w, b, eps: float, lanes: int = 8):
    """ggml_norm, then mul by w and add b: the mean by ggml_vec_sum_f32 (float64 in order, rounded to float, / n
    in float), the variance by ggml_vec_cvar_f32 (the centred values' squares summed `lanes` at a time by hsum, the
    chunk sums and the leftovers accumulated in float64, / n), the scale 1/sqrtf(var + eps)."""
    n = x.shape[-1]
    mean = (np.cumsum(x, axis=-1, dtype=F64)[..., -1:].astype(F32) / F32(n)).astype(F32)
    c = (x - mean).astype(F32)
    sq = (c * c).astype(F32)
    body = n // lanes * lanes
    chunks = hsum(sq[..., :body].reshape(sq.shape[:-1] + (body // lanes, lanes)))
    total = np.zeros(sq.shape[:-1] + (1,), dtype=F64)
    for i in range(body // lanes):
        total = total + chunks[..., i:i + 1].astype(F64)
    for i in range(body, n):
        total = total + sq[..., i:i + 1].astype(F64)
    scale = (F32(1) / np.sqrt((total / n).astype(F32) + F32(eps))).astype(F32)
    return ((c * scale) * w + b).astype(F32)


def silu(xp, x, lanes: int = 8):
    """ggml_v_silu: x / (1 + v_expf(-x)), float32."""
    return (x / (F32(1) + v_expf((F32(0) - x).astype(F32), lanes))).astype(F32)


_GELU_TABLE = []


def gelu_table():
    """ggml_table_gelu_f16: for every float16 bit pattern, gelu_tanh of its value (ggml_gelu_f32, float32,
    tanhf correctly rounded) rounded to float16; returned widened to float32 [65536]. The compiler contracts
    1 + A*x*x into fma(A*x, x, 1) (found on the value -1.999, whose float16 rounding flips without it)."""
    if not _GELU_TABLE:
        x = np.arange(1 << 16, dtype=np.uint16).view(F16).astype(F32)
        with np.errstate(all="ignore"):
            inner = (F32(0.7978845608028654) * x * fma(F32(0.044715) * x, x, F32(1))).astype(F32)
            t = np.tanh(inner.astype(F64)).astype(F32)                 # tanhf, correctly rounded
            _GELU_TABLE.append((F32(0.5) * x * (F32(1) + t)).astype(F16).astype(F32))
    return _GELU_TABLE[0]


def geglu_act(x, g):
    """ggml_vec_geglu_f32 (GGML_GELU_FP16 build): x, g [..., F] f32 -> gelu(x) * g, gelu read from the float16
    table at float16(x); x <= -10 gives 0, x >= 10 gives x * g."""
    y = gelu_table()[x.astype(F16).view(np.uint16)] * g
    return np.where(x <= -10, F32(0), np.where(x >= 10, x * g, y)).astype(F32)


def gelu(x):
    """ggml_vec_gelu_f32 (GGML_GELU_FP16 build): x [...] f32 -> gelu read from the float16 table at float16(x);
    x <= -10 gives 0, x >= 10 gives x."""
    y = gelu_table()[x.astype(F16).view(np.uint16)]
    return np.where(x <= -10, F32(0), np.where(x >= 10, x, y)).astype(F32)


def softmax(xp, s, lanes: int = 8):
    """ggml_vec_soft_max_f32 + scale: s [..., S] (masked with -inf) -> probabilities [..., S] f32.

    exp by v_expf in chunks of `lanes` from column 0, chunk sums (hsum order) accumulated in float64,
    then multiplied by (float)(1/sum)."""
    s = np.asarray(s, dtype=F32)
    n = s.shape[-1]
    n8 = -(-n // lanes) * lanes
    m = s.max(axis=-1, keepdims=True)
    w = np.full(s.shape[:-1] + (n8,), -np.inf, dtype=F32)
    w[..., :n] = s
    with np.errstate(invalid="ignore"):
        e = v_expf((w - m).astype(F32), lanes)
    chunks = hsum(e.reshape(e.shape[:-1] + (n8 // lanes, lanes)))          # [..., n8/lanes] f32
    total = np.zeros(s.shape[:-1], dtype=F64)
    for i in range(chunks.shape[-1]):
        total = total + chunks[..., i].astype(F64)
    return (e[..., :n] * (1.0 / total).astype(F32)[..., None]).astype(F32)


def rope_angles(xp, n_pos: int, rope_dim: int, base: float, freq_scale: float = 1.0, factors=None, map_c=None,
                ramp=None):
    """ggml_rope_cache_init: theta *= theta_scale in float32, theta / freq_factor, * freq_scale, cos/sin from
    the C library's cosf/sinf; with YaRN's ramp (ext_factor 1), rope_yarn's mix as compiled (FMA-contracted):
    fma(theta * freq_scale, 1 - r, theta * r). Built once per set of arguments (a quarter of a million distinct angles in an
    8192-position table): every cache, and every layer of a local check, shares the read-only tables. map_c(f, xs):
    the C function f (float -> float) applied to float32 xs, where a caller has a faster way to call it than one
    ctypes call a value (the numba backend's numba_ggml.map_c_float); the same calls, the same values."""
    key = (int(n_pos), int(rope_dim), float(base), float(freq_scale),
           None if factors is None else tuple(float(f) for f in np.asarray(factors, dtype=F32)),
           None if ramp is None else tuple(float(r) for r in np.asarray(ramp, dtype=F32)))
    if key not in _ROPE_TABLES:             # keyed without map_c: its tables are the same, whoever builds them
        c, s = _rope_tables_uncached(*key, map_c)
        c.flags.writeable = s.flags.writeable = False
        while len(_ROPE_TABLES) >= 8:
            _ROPE_TABLES.pop(next(iter(_ROPE_TABLES)))
        _ROPE_TABLES[key] = c, s
    return _ROPE_TABLES[key]


_ROPE_TABLES: dict = {}                     # the last 8 sets of rope_angles' arguments -> read-only (cos, sin)


def libm_cosf_sinf():
    """The C library's cosf and sinf (ctypes functions, float -> float): ggml's RoPE calls these."""
    import ctypes
    import ctypes.util

    libm = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")
    cosf, sinf = libm.cosf, libm.sinf
    for f in (cosf, sinf):
        f.restype, f.argtypes = ctypes.c_float, [ctypes.c_float]
    return cosf, sinf


def _rope_tables_uncached(n_pos, rope_dim, base, freq_scale, factors, ramp=None, map_c=None):
    cosf, sinf = libm_cosf_sinf()
    theta_scale = F32(base ** (-2.0 / rope_dim))
    theta = np.arange(n_pos, dtype=F32)
    cols = []
    for _ in range(rope_dim // 2):
        cols.append(theta)
        theta = (theta * theta_scale).astype(F32)
    ang = np.stack(cols, axis=1)
    if factors is not None:
        ang = (ang / np.asarray(factors, dtype=F32)[None, :]).astype(F32)
    if ramp is not None:
        r = np.asarray(ramp, dtype=F32)[None, :]
        ang = fma((ang * F32(freq_scale)).astype(F32), (F32(1) - r).astype(F32), (ang * r).astype(F32))
    elif freq_scale != 1.0:
        ang = (ang * F32(freq_scale)).astype(F32)
    uniq, inv = np.unique(ang, return_inverse=True)
    if map_c is None:                   # one ctypes call a distinct angle, mapped over a list
        at = uniq.tolist()
        map_c = lambda f, xs: np.fromiter(map(f, at), F32, len(at))          # noqa: E731
    return map_c(cosf, uniq)[inv].reshape(ang.shape), map_c(sinf, uniq)[inv].reshape(ang.shape)


def rope(xp, x, cos, sin, style: str):
    """ggml's rotate_pairs as compiled (FMA-contracted): y0 = fma(x0, c, -(x1*s)), y1 = fma(x0, s, x1*c)."""
    r = 2 * cos.shape[-1]
    c, s = cos[:, None, :], sin[:, None, :]
    out = x.copy()
    i0, i1 = (np.s_[..., 0:r:2], np.s_[..., 1:r:2]) if style == "adjacent" else \
        (np.s_[..., : r // 2], np.s_[..., r // 2: r])
    x0, x1 = x[i0], x[i1]
    out[i0] = fma(x0, c, -(x1 * s))
    out[i1] = fma(x0, s, x1 * c)
    return out


def _lanes(a, b, lanes=8):
    """sum_k a[..., k] * b[..., k] as tinyBLAS computes it: `lanes`-lane FMA over k (k % lanes == 0), then hsum."""
    k = a.shape[-1]
    acc = np.zeros(np.broadcast_shapes(a.shape[:-1], b.shape[:-1]) + (lanes,), dtype=F32)
    for c in range(k // lanes):
        acc = fma(a[..., c * lanes:(c + 1) * lanes], b[..., c * lanes:(c + 1) * lanes], acc)
    return hsum(acc)


def _vec_dot_f32(a, b, leftovers_f64=False, lanes=8):
    """ggml_vec_dot_f32: 4 accumulators of `lanes` lanes over steps of 4 * lanes, added pairwise ((0+2)+(1+3)),
    then the lanes summed (AVX2: hadd twice; AVX-512: _mm512_reduce_add_ps, as hsum), then the leftovers added
    one by one in float32 (product rounded, no FMA), as measured against the AVX2 build. ggml_vec_dot_f16 is the
    same on f16 values, except that its leftovers accumulate in double."""
    k, step = a.shape[-1], 4 * lanes
    np_ = k - k % step
    acc = np.zeros(np.broadcast_shapes(a.shape[:-1], b.shape[:-1]) + (4, lanes), dtype=F32)
    for i in range(0, np_, step):
        acc = fma(a[..., i:i + step].reshape(a.shape[:-1] + (4, lanes)),
                  b[..., i:i + step].reshape(b.shape[:-1] + (4, lanes)), acc)
    x0 = (acc[..., 0, :] + acc[..., 2, :]) + (acc[..., 1, :] + acc[..., 3, :])
    if lanes == 16:
        res = hsum(x0)
    else:
        t0 = x0[..., :4] + x0[..., 4:]
        res = (t0[..., 0] + t0[..., 1]) + (t0[..., 2] + t0[..., 3])
    res = res.astype(F64 if leftovers_f64 else F32)
    for i in range(np_, k):
        res = (res + (a[..., i] * b[..., i]).astype(res.dtype)).astype(res.dtype)
    return res.astype(F32)


def _pad(a, n):
    """Zero-pad the last axis to n (ggml pads the KV length; the zeros add nothing to any FMA lane)."""
    if a.shape[-1] == n:
        return a
    out = np.zeros(a.shape[:-1] + (n,), dtype=a.dtype)
    out[..., : a.shape[-1]] = a
    return out


def make_attention(kv_dtype: str, lanes: int = 8):
    """-> attention(xp, q, k, v, mask, scale, kv_head) reproducing llama.cpp's non-flash CPU attention.

    kv_dtype 'float32': Q.K^T by ggml_vec_dot_f32 (the permuted Q is not contiguous), P.V by tinyBLAS f32.
    kv_dtype 'float16': Q and P rounded to f16; both products by tinyBLAS f16. With one new token, llama.cpp
    uses its own vec_dot (f32 or f16) instead of tinyBLAS for every product; so do we."""

    def attention(xp, q, k, v, mask, scale, kv_head):
        t, h, hd = q.shape
        s = k.shape[0]
        f16 = kv_dtype == "float16"
        rnd = (lambda a: a.astype(F16).astype(F32)) if f16 else (lambda a: a)
        qh = rnd(q).transpose(1, 0, 2)[:, :, None, :]                             # [H, T, 1, Hd]
        kh = k[:, kv_head, :].transpose(1, 0, 2)[:, None, :, :]                  # [H, 1, S, Hd]
        if f16 and t > 1 and hd % lanes == 0:
            kq = _lanes(qh, kh, lanes)                                             # tinyBLAS f16
        else:
            kq = _vec_dot_f32(qh, kh, leftovers_f64=f16, lanes=lanes)              # ggml_vec_dot_f32/f16
        probs = softmax(xp, (kq * F32(scale)).astype(F32) + mask, lanes)           # [H, T, S]
        vt = v[:, kv_head, :].transpose(1, 2, 0)                                   # [H, Hd, S]
        if t > 1:
            s8 = -(-s // lanes) * lanes
            out = _lanes(_pad(rnd(probs), s8)[:, :, None, :], _pad(vt, s8)[:, None, :, :], lanes)   # tinyBLAS
        else:
            s32 = -(-s // (4 * lanes)) * 4 * lanes
            out = _vec_dot_f32(_pad(rnd(probs), s32)[:, :, None, :], _pad(vt, s32)[:, None, :, :],
                               leftovers_f64=f16, lanes=lanes)
        return out.transpose(1, 0, 2).reshape(t, h * hd), kq, probs
    return attention


def flash_attention(xp, q, k, v, mask, scale, kv_head):
    """llama.cpp's CPU flash attention on an F16 K/V cache (the fused FLASH_ATTN_EXT op): Q rounded to f16;
    per query, the keys in order with the online softmax (running max M and sum S, libm expf); the weighted
    sum of V kept in f16, every multiply-add and rescale rounded to f16; divided by S at the end. An F32
    cache is cast to f16 first (llama.cpp's graph casts K and V for flash attention, build_attn_mha).
    q: [T, H, Hd]; k, v: [S, KV, Hd]; mask: [T, S] -> [T, H*Hd] (no kq or probs: fused)."""
    k, v = (np.asarray(a).astype(F16).astype(F32) for a in (k, v))
    t, h, hd = q.shape
    q16 = q.astype(F16).astype(F64)
    kh = k[:, kv_head, :].astype(F64)                                       # [S, H, Hd]
    vh = v[:, kv_head, :].astype(F32)
    scores = np.einsum("thd,shd->ths", q16, kh).astype(F32)                 # [T, H, S] ggml_vec_dot_f16
    scores = (scores * F32(scale)).astype(F32) + np.asarray(mask, F32)[:, None, :].astype(F16).astype(F32)
    m = np.full((t, h), -np.inf, F32)
    ssum = np.zeros((t, h), F32)
    acc = np.zeros((t, h, hd), F16)
    with np.errstate(invalid="ignore", over="ignore"):
        for j in range(scores.shape[-1]):
            sj = scores[:, :, j]
            live = sj != -np.inf                                             # masked keys are skipped
            up = live & (sj > m)
            ms = np.where(up, np.exp(np.where(up, m - sj, 0).astype(F32)), F32(1)).astype(F32)
            vs = np.where(up | ~live, F32(1), np.exp(np.where(live, sj - m, 0).astype(F32))).astype(F32)
            m = np.where(up, sj, m)
            acc = np.where(up[..., None], (acc.astype(F32) * ms[..., None]).astype(F16), acc)
            mad = (acc.astype(F64) + vh[j][None].astype(F64) * vs[..., None].astype(F64)).astype(F32).astype(F16)
            acc = np.where(live[..., None], mad, acc)
            ssum = np.where(live, (ssum * ms + vs).astype(F32), ssum)
    inv = np.where(ssum == 0, F32(0), (F32(1) / ssum).astype(F32))
    return (acc.astype(F32) * inv[..., None]).astype(F32).reshape(t, h * hd)


def make_ops(kv_dtype: str = "float32", lanes: int = 8):
    """The layer-function namespace for numerics='ggml': the reference layers with ggml's kernels swapped in, for
    a build of `lanes` float32 lanes (SIMD_LANES)."""
    import types

    def silu_(xp, x):
        return silu(xp, x, lanes)

    def softmax_(xp, s):
        return softmax(xp, s, lanes)

    def swiglu(xp, x, w_gate, w_up, w_down):
        h = (silu_(xp, layers.linear(xp, x, w_gate)) * layers.linear(xp, x, w_up)).astype(F32)
        return layers.linear(xp, h, w_down), h

    def geglu(xp, x, w_gate, w_up, w_down):
        h = geglu_act(layers.linear(xp, x, w_gate), layers.linear(xp, x, w_up))
        return layers.linear(xp, h, w_down), h

    def gelu_mlp(xp, x, w_up, b_up, w_down, b_down):                # GPT-2: ggml_add of each bias, GELU's table
        h = gelu((layers.linear(xp, x, w_up) + b_up).astype(F32))
        return (layers.linear(xp, h, w_down) + b_down).astype(F32), h

    def layer_norm_(xp, x, w, b, eps):
        return layer_norm(xp, x, w, b, eps, lanes)

    ops = types.SimpleNamespace(**{n: getattr(layers, n) for n in dir(layers) if not n.startswith("_")})
    ops.rope_angles, ops.rope, ops.softmax, ops.silu, ops.rms_norm = rope_angles, rope, softmax_, silu_, rms_norm
    ops.attention, ops.swiglu, ops.geglu = make_attention(kv_dtype, lanes), swiglu, geglu
    ops.layer_norm, ops.gelu_mlp = layer_norm_, gelu_mlp
    ops.name, ops.kv_dtype, ops.lanes = f"ggml (kv {kv_dtype}, {lanes} lanes)", kv_dtype, lanes
    return ops


# -- K-quants (super-blocks of 256) against Q8_K activations -------------------------------------------
QK_K = 256


def quantize_q8_k(x):
    """quantize_row_q8_K_ref: x [T, K] -> q [T, NB, 256] (f32 integers), d [T, NB] f32, bsums [T, NB, 16].

    iscale = -127 / (the value of largest magnitude, sign kept); q = nearest_int(iscale * x) capped at 127;
    d = 1 / iscale (a float32, not rounded to f16)."""
    t, k = x.shape
    xb = x.reshape(t, k // QK_K, QK_K).astype(F32)
    idx = np.abs(xb).argmax(axis=-1)                                       # first index of the largest |x|
    mx = np.take_along_axis(xb, idx[..., None], axis=-1)[..., 0]
    with np.errstate(divide="ignore", invalid="ignore"):
        iscale = np.where(mx != 0, F32(-127) / mx, F32(0)).astype(F32)
        q = np.minimum(np.rint((xb * iscale[..., None]).astype(F32)), F32(127)).astype(F32)
        d = np.where(mx != 0, F32(1) / iscale, F32(0)).astype(F32)
    q[mx == 0] = 0
    bsums = q.reshape(t, k // QK_K, 16, 16).sum(-1)
    return q, d, bsums


def k4_scales(sc):
    """get_scale_min_k4 for the 12 scale bytes of a Q4_K block -> scales [.., 8], mins [.., 8] (6-bit)."""
    sc = sc.astype(np.int32)
    s = np.empty(sc.shape[:-1] + (8,), np.int32)
    m = np.empty_like(s)
    s[..., :4], m[..., :4] = sc[..., 0:4] & 63, sc[..., 4:8] & 63
    s[..., 4:] = (sc[..., 8:12] & 0xF) | ((sc[..., 0:4] >> 6) << 4)
    m[..., 4:] = (sc[..., 8:12] >> 4) | ((sc[..., 4:8] >> 6) << 4)
    return s, m


def k_codes(blk, qtype):
    """Q5_K or Q6_K blocks [N, NB, bytes] -> their codes [N, NB, 256] int32 in element order (Q5_K 0..31: the low
    nibbles of 32-byte chunk j are group 2j, the high ones 2j+1, bit g of qh[l] the fifth bit of group g; Q6_K
    0..63, the -32 not applied)."""
    if qtype == "Q5_K":
        qh = blk[..., 16:48].astype(np.int32)                                      # [N, NB, 32]
        qs = blk[..., 48:176].reshape(blk.shape[:2] + (4, 32)).astype(np.int32)
        chunks = []
        for j in range(4):
            chunks += [(qs[:, :, j] & 15) + (((qh >> (2 * j)) & 1) << 4),
                       (qs[:, :, j] >> 4) + (((qh >> (2 * j + 1)) & 1) << 4)]
        return np.concatenate(chunks, axis=-1)
    ql, qh = blk[..., 0:128].astype(np.int32), blk[..., 128:192].astype(np.int32)
    parts = []
    for j in range(2):
        l0, l1, h = ql[..., 64 * j:64 * j + 32], ql[..., 64 * j + 32:64 * j + 64], qh[..., 32 * j:32 * j + 32]
        parts += [(l0 & 15) | ((h & 3) << 4), (l1 & 15) | (((h >> 2) & 3) << 4),
                  (l0 >> 4) | (((h >> 4) & 3) << 4), (l1 >> 4) | (((h >> 6) & 3) << 4)]
    return np.concatenate(parts, axis=-1)


class KQuantMatrix(SpanProduct):
    """A Q2_K..Q6_K weight [N, K]; matmul(x) reproduces ggml_vec_dot_qN_K_q8_K (AVX2 kernels): per
    super-block, 8 int32 lanes (lane l = elements 4l..4l+3 of each 32-element group, times that group's
    scale), one FMA per super-block, hsum; Q4_K adds its mins through 4 FMA lanes on Q8_K's block sums."""

    def __init__(self, qt):
        self.qtype, self.shape, self.qt = qt.qtype, tuple(qt.shape), qt
        self.nb = None                   # unpacked on the first product: a backend with its own kernel never does
        if qt.qtype not in ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"):
            raise NotImplementedError(qt.qtype)

    def _unpack(self):
        """The codes as float32 lanes for batched integer products, the scales and mins (4x the blocks' bytes)."""
        qtype, raw = self.qtype, self.qt.blocks
        n = raw.shape[0]
        if qtype == "Q4_K":
            blk = np.asarray(raw).reshape(n, -1, 144)
            self.d, self.dmin = f16_at(blk, 0), f16_at(blk, 2)
            self.sc, self.mins = k4_scales(blk[..., 4:16])                    # [N, NB, 8]
            qs = blk[..., 16:144].reshape(n, -1, 4, 32)
            q = np.stack([qs & 15, qs >> 4], axis=3).reshape(n, -1, QK_K)     # [N, NB, 256]: 64 per chunk
            # per element: the scale of its 32-group
            self.group_scale = self.sc                                          # [N, NB, 8]
        elif qtype == "Q5_K":
            blk = np.asarray(raw).reshape(n, -1, 176)
            self.d, self.dmin = f16_at(blk, 0), f16_at(blk, 2)
            self.sc, self.mins = k4_scales(blk[..., 4:16])
            q = k_codes(blk, "Q5_K")                                                 # [N, NB, 256]
        elif qtype == "Q2_K":
            blk = np.asarray(raw).reshape(n, -1, 84)
            sc = blk[..., 0:16].astype(np.int32)
            self.scales16, self.mins16 = sc & 15, sc >> 4                         # per 16 elements
            self.d, self.dmin = f16_at(blk, 80), f16_at(blk, 82)
            qs = blk[..., 16:80].astype(np.int32)
            q = np.concatenate([(qs[..., 32 * j:32 * j + 32] >> (2 * k)) & 3 for j in range(2) for k in range(4)], -1)
        elif qtype == "Q3_K":
            blk = np.asarray(raw).reshape(n, -1, 110)
            hm = blk[..., 0:32].astype(np.int32)
            qs = blk[..., 32:96].astype(np.int32)
            aux = np.ascontiguousarray(blk[..., 96:108]).view("<u4").astype(np.int64)   # [N, NB, 3]
            k1, k2 = 0x03030303, 0x0F0F0F0F
            words = [(aux[..., 0] & k2) | (((aux[..., 2] >> 0) & k1) << 4),
                     (aux[..., 1] & k2) | (((aux[..., 2] >> 2) & k1) << 4),
                     ((aux[..., 0] >> 4) & k2) | (((aux[..., 2] >> 4) & k1) << 4),
                     ((aux[..., 1] >> 4) & k2) | (((aux[..., 2] >> 6) & k1) << 4)]
            sb = np.stack(words, -1).astype("<u4").view(np.uint8).astype(np.int32)          # [N, NB, 16]
            self.scales16 = sb - 32
            self.d = f16_at(blk, 108)
            q = np.concatenate([((qs[..., 32 * j:32 * j + 32] >> (2 * k)) & 3)
                                - 4 * (1 - ((hm >> (4 * j + k)) & 1)) for j in range(2) for k in range(4)], -1)
        elif qtype == "Q6_K":
            blk = np.asarray(raw).reshape(n, -1, 210)
            self.scales16 = blk[..., 192:208].view(np.int8).astype(np.int32)    # [N, NB, 16]
            self.d = f16_at(blk, 208)
            q = k_codes(blk, "Q6_K")                                             # [N, NB, 256] in 0..63; the
            # -32 offset is applied at the end through Q8_K's block sums, as ggml's AVX2 kernel does
        else:
            raise NotImplementedError(qtype)
        nb = q.shape[1]
        # [NB, 8 groups, 8 lanes, 4, N] for batched integer products
        self.q_lanes = np.ascontiguousarray(q.reshape(n, nb, 8, 8, 4).transpose(1, 2, 3, 4, 0).astype(F32))
        self.nb = nb

    def _matmul(self, x):
        if self.nb is None:
            self._unpack()
        qa, da, bsums = quantize_q8_k(x)
        t, n = x.shape[0], self.shape[0]
        qa_l = qa.reshape(t, self.nb, 8, 8, 4)
        acc = np.zeros((t, n, 8), dtype=F32)
        acc_m = np.zeros((t, n, 4), dtype=F32)
        summs = np.zeros((t, n), dtype=F32)
        for b in range(self.nb):
            # P[g, l, t, n] = sum_k q[n, 32g + 4l + k] * q8[t, 32g + 4l + k]   (exact integers)
            p = np.matmul(qa_l[:, b].transpose(1, 2, 0, 3), self.q_lanes[b]).astype(F64)   # [8, 8, T, N]
            if self.qtype == "Q5_K":
                sumi = np.einsum("gltn,ng->tnl", p, self.sc[:, b].astype(F64))
                d = (da[:, b, None] * self.d[None, :, b]).astype(F32)
                dmin = ((-da[:, b, None]) * self.dmin[None, :, b]).astype(F32)
                q8s = bsums[:, b].reshape(t, 8, 2).sum(-1).astype(F64)
                mins_dot = (self.mins[:, b].astype(F64)[None] * q8s[:, None, :]).sum(-1).astype(F32)   # exact int
                summs = fma(dmin, mins_dot, summs)                 # summs += dmin * (float)sum, contracted
            elif self.qtype == "Q4_K":
                sc = self.sc[:, b].astype(F64)                                       # [N, 8]
                sumi = np.einsum("gltn,ng->tnl", p, sc)
                d = (da[:, b, None] * self.d[None, :, b]).astype(F32)              # [T, N]
                dmin = ((-da[:, b, None]) * self.dmin[None, :, b]).astype(F32)
                q8s = bsums[:, b].reshape(t, 8, 2).sum(-1).astype(F64)             # [T, 8] sums per 32-group
                prod = np.einsum("ng,tg->tng", self.mins[:, b].astype(F64), q8s).reshape(t, n, 4, 2).sum(-1)
                acc_m = fma(dmin[..., None], prod.astype(F32), acc_m)
            else:                                                                    # Q2_K, Q3_K, Q6_K
                if self.qtype == "Q2_K":
                    # the mins first, into the same accumulator: lane l = m[2l] bsum[2l] + m[2l+1] bsum[2l+1]
                    prod = np.einsum("tlk,nlk->tnl", bsums[:, b].astype(F64).reshape(t, 8, 2),
                                     self.mins16[:, b].astype(F64).reshape(n, 8, 2))
                    dmin = ((-da[:, b, None]) * self.dmin[None, :, b]).astype(F32)
                    acc = fma(dmin[..., None], prod.astype(F32), acc)
                sc16 = self.scales16[:, b].astype(F64).reshape(n, 8, 2)            # [N, group, half]
                lane_half = (np.arange(8) >= 4).astype(int)                          # lanes 4..7: second half
                sc = sc16[:, :, lane_half]                                           # [N, 8 groups, 8 lanes]
                sumi = np.einsum("gltn,ngl->tnl", p, sc)
                if self.qtype == "Q6_K":
                    # q8sclsub: lane l -= 32 * (bsums[2l] * scale[2l] + bsums[2l+1] * scale[2l+1])
                    bs = bsums[:, b].astype(F64).reshape(t, 8, 2)                   # [T, lane, 2]
                    s16 = self.scales16[:, b].astype(F64).reshape(n, 8, 2)          # [N, lane, 2]
                    sumi = sumi - 32 * np.einsum("tlk,nlk->tnl", bs, s16)
                d = (da[:, b, None] * self.d[None, :, b]).astype(F32)
            acc = fma(d[..., None], sumi.astype(F32), acc)
        y = hsum8(acc)
        if self.qtype == "Q4_K":
            y = y + ((acc_m[..., 0] + acc_m[..., 2]) + (acc_m[..., 1] + acc_m[..., 3]))
        elif self.qtype == "Q5_K":
            y = y + summs
        return y.astype(F32)


def matrix_of(qt, what: str = ""):
    """numerics="ggml": the product llama.cpp's CPU backend computes with this QTensor's blocks (the same in AVX2
    and AVX-512 builds: see the module's docstring)."""
    if qt.qtype in ACT_TYPE:
        return LegacyQuantMatrix(qt)
    if qt.qtype in ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"):
        return KQuantMatrix(qt)
    raise UnsupportedModelError(f"{what or qt.name or 'a weight'}: numerics='ggml' does not implement {qt.qtype} "
                                f"products yet (implemented: F32, F16, {', '.join(ACT_TYPE)}, Q2_K..Q6_K); use "
                                f"numerics='exact'")
