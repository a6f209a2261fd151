"""Row dot products that read GGUF blocks where they lie: explicit 16-lane vector code through LLVM IR.

numba vectorizes a loop over one block's 16 or 32 weights only with a horizontal sum per block or with
runtime alias checks, so a plain numba loop would need the file's row-major blocks laid out again. These intrinsics build the loop over a row's blocks in LLVM IR with vector types: each block's
weights are made as 16-lane float vectors (`_weights`), each weight the float32 value the NumPy oracle's
dequantization gives it, bit for bit (a float16 scale times an integer sub-scale and a code, all exact in
float32, plus or minus a min term with one rounding: one fused multiply-add); each is multiplied by x's 16
matching floats and added to a lane accumulator with a fused multiply-add (llvm.fma, no fast-math otherwise:
nothing reassociated); one fixed-order tree sum at the row's end. A row's result is therefore the same
whatever the thread count or tile, and differs from the oracle's (dequantized weights times x in BLAS) by
the order of the sums only.

4-bit codes (Q4_0, Q4_1, Q4_K) on AVX-512: the sixteen weights a block's scale and min allow are computed
once (one fused multiply-add of the codes 0..15; Q4_0's one multiply of the codes less 8) and looked up per
code with one vpermps, instead of a mask, a conversion and a multiply-add per 16 codes; elsewhere the codes are
converted. The two give the same floats (`TABLES` picks one when the kernels are compiled, for the CPU numba
compiles for). With the lookups the codes are read from their bytes' 32-bit words by one broadcast load and one
shift per 16 codes (`WORDS`: no widening of bytes to lanes, a shuffle port's work), which puts each 32 of a
block's weights in an order of their own (LANE_ORDER; matmul_rows reads x in that order): the two builds' sums
of a 4-bit product run in different orders, over the same weights.

`dot_tile` is the intrinsic numba code calls: R rows by T tokens at once (R, T and the type constants), each
row's blocks decoded once for its T tokens and x's floats loaded once for the R rows.
"""
from __future__ import annotations

from . import numba_wide_vectors

numba_wide_vectors()            # before numba reads its configuration: 512-bit vectors on AVX-512 CPUs

import os  # noqa: E402

import llvmlite.binding as ll  # noqa: E402
import numpy as np  # noqa: E402
from llvmlite import ir  # noqa: E402
from numba import types  # noqa: E402
from numba.extending import intrinsic  # noqa: E402

L = 16
F32, F16 = ir.FloatType(), ir.HalfType()
I8, I16, I32, I64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
VF, VI32, VI8 = ir.VectorType(F32, L), ir.VectorType(I32, L), ir.VectorType(I8, L)

# ggml type -> (weights per block, bytes per block); each a type _weights decodes
BLOCKS = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24), "Q8_0": (32, 34),
          "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210), "Q2_K": (256, 84), "Q3_K": (256, 110)}
ACCUMULATORS = {32: 2, 256: 4}                # lane accumulators a (row, token) has, by block length
# Several tokens' products from a panel of 4 rows' weights decoded once (numba_kernels._panels_times): the float
# tile (rows, tokens, passes) by ACCUMULATORS: 32-weight blocks 4 x 3 with their 2 accumulators each (24 registers);
# K-quants 4 x 4 one accumulator at a time (passes: _emit_float_tile; 4 x 4 x 4 would spill). Panels serve
# PANEL_TOKENS tokens or more (by SUPER: 32-weight blocks, 256), chosen by tools/kernel_ab.py --base-set PANEL_TOKENS=...
PANEL_TILE = {2: (4, 3, False), 4: (4, 4, True)}
PANEL_TOKENS = (16, 8)
PANEL_PASSES = (PANEL_TILE[2][2], PANEL_TILE[4][2])
PANEL_CHUNK = (2048, 1024)     # weights a chunk: rows of up to 2048 weights in one, longer rows in 1024s
# For one token, super-block types: rows a loop takes (more rows at once spill registers; Q4_K's two rows decode
# their 6-bit scales together, _k4_scales), and whether the broadcast loads that splat a block's scales are volatile
# (SPLAT_LOADS) or plain behind a barrier (_splats_from_memory). Chosen on Zen 5 by tools/kernel_ab.py, each
# alternative against these settings in one process: Q2_K four rows, Q3_K and Q6_K two, their splats behind the
# barrier, 1.36-1.38x, 1.07x and 0.99-1.17x one row with volatile loads (Q2_K two rows 1.33-1.37x; Q3_K four rows
# 0.92-0.94x; Q6_K four 0.98x; Q5_K two 0.89-0.99x; Q4_K four rows 1.00-1.02x).
SUPER_ROWS = {"Q4_K": 2, "Q5_K": 1, "Q6_K": 2, "Q2_K": 4, "Q3_K": 2}
SPLAT_LOADS = ("Q5_K",)
SCALE_VECTORS = ("Q4_K", "Q5_K", "Q6_K", "Q2_K", "Q3_K")   # super-block types whose scales are decoded to a vector


def _compiles_for(feature: str) -> bool:
    """Whether numba's code is built for a CPU with `feature` (an LLVM feature name): its NUMBA_CPU_FEATURES
    when set (numba_wide_vectors sets it on AVX-512 hosts), else the host's own."""
    given = os.environ.get("NUMBA_CPU_FEATURES")
    if given:
        return f"+{feature}" in given.split(",")
    ll.initialize_native_target()
    return bool(ll.get_host_cpu_features().get(feature))


TABLES = _compiles_for("avx512f")     # 4-bit codes' weights by a 16-entry lookup (one vpermps) or by conversion
WORDS = TABLES         # 4-bit codes read from 32-bit words (_Block.codes4): with lookups 1.03-1.15x one-token on
#                       AVX-512; with conversions 0.83-0.88x (Q4_0, Q4_1) on the AVX2 build (tools/kernel_ab.py)
SCALES_AHEAD = TABLES  # one token's super-block scales decoded an iteration ahead (_emit_tile): on Zen 5's AVX-512
#                       build 1.08-1.14x; on its AVX2 build Q4_K and Q5_K 0.99-1.00x, Q6_K 0.95-0.96x
#                       (tools/kernel_ab.py)


def _vi(v):
    return ir.Constant(VI32, [v] * L) if isinstance(v, int) else ir.Constant(VI32, list(v))


class _Block:
    """Reads of one block at i8* p."""

    def __init__(self, b, p):
        self.b, self.p = b, p

    def splats(self, v):
        """v <16 x float> (a super-block's scales) -> splat(j): lane j of v in every lane, by a lane shuffle (for
        several tokens, where the splats are shared; one token's tiles splat by broadcast loads: _emit_tile)."""
        return lambda j: _lanes(self.b, v, [j] * L)

    def at(self, off, ty):
        return self.b.bitcast(self.b.gep(self.p, [ir.Constant(I64, off)]), ty.as_pointer())

    def f16(self, off):
        return self.b.fpext(self.b.load(self.at(off, F16), align=1), F32)

    def f16_splats(self, off, n):
        """The n (1 or 2) float16s at off, each as a float32 in every lane: n <16 x float> (one broadcast read,
        one conversion, and for two an in-lane shuffle each)."""
        b, it = self.b, ir.IntType(16 * n)
        v = b.insert_element(ir.Constant(ir.VectorType(it, 16 // n), ir.Undefined), b.load(self.at(off, it), align=1),
                             ir.Constant(I32, 0))
        v = b.shuffle_vector(v, v, ir.Constant(ir.VectorType(I32, 16 // n), [0] * (16 // n)))
        h = b.fpext(b.bitcast(v, ir.VectorType(F16, L)), VF)
        return [b.shuffle_vector(h, h, ir.Constant(VI32, [2 * (j // 2) + i for j in range(L)])) if n == 2 else h
                for i in range(n)]

    def u8(self, off):
        return self.b.zext(self.b.load(self.at(off, I8), align=1), I32)

    def i8(self, off):
        return self.b.sext(self.b.load(self.at(off, I8), align=1), I32)

    def u32(self, off):
        return self.b.load(self.at(off, I32), align=1)

    def bytes16(self, off, signed=False):
        v = self.b.load(self.at(off, VI8), align=1)
        return self.b.sext(v, VI32) if signed else self.b.zext(v, VI32)

    def codes4(self, off, n_bytes):
        """The 4-bit codes of the n_bytes (16 or 32) at off -> part(half, seg): 16 codes, those of bytes 16 seg..
        16 seg + 15 (seg 0 for 16 bytes), their low (half 0) or high (half 1) four bits, in each lane's low four
        bits (the bits above not cleared: _codes_times' lookup reads only those four, its conversion masks them).
        With WORDS, the bytes' 32-bit words repeated across the lanes by one broadcast load (no widening of bytes
        to lanes, a shuffle port's work), each repeat shifted right by one more byte, and a part one shift of
        that (LLVM makes the two one variable shift): lane l's code from byte 4 (l % words) + l // words + 2 seg,
        the order LANE_ORDER gives; otherwise the bytes widened to lanes in the file's order and shifted."""
        b = self.b
        if not WORDS:
            return lambda half, seg: b.lshr(self.bytes16(off + 16 * seg), _vi(4 * half))
        words = n_bytes // 4
        v = b.load(self.at(off, ir.VectorType(I32, words)), align=1)
        v = b.lshr(b.shuffle_vector(v, v, ir.Constant(VI32, [lane % words for lane in range(L)])),
                   _vi([8 * (lane // words) for lane in range(L)]))
        return lambda half, seg: b.lshr(v, _vi(16 * seg + 4 * half)) if half or seg else v

    def bits16(self, word, first):
        """((word >> (first + j)) & 1) << 4 for lanes j: a 32-bit mask's 16 high bits of codes."""
        b = self.b
        w = b.shuffle_vector(b.insert_element(ir.Constant(VI32, ir.Undefined), word, ir.Constant(I32, 0)),
                             ir.Constant(VI32, ir.Undefined), ir.Constant(VI32, [0] * L))
        return b.shl(b.and_(b.lshr(w, _vi(range(first, first + L))), _vi(1)), _vi(4))

    def fl(self, v):
        return self.b.sitofp(v, VF)


def _nibbles(k, q, shift):
    return k.b.and_(k.b.lshr(q, _vi(shift)), _vi(15)) if shift else k.b.and_(q, _vi(15))


def _lanes(b, v, idx):
    return b.shuffle_vector(v, v, ir.Constant(ir.VectorType(I32, len(idx)), list(idx)))


def _k4_scales(blocks):
    """get_scale_min_k4 for the 8 groups of each of `blocks` (one or two super-blocks: two rows decoded in one pass),
    from the 12 scale bytes q at offset 4, as floats: (d sc, -(dmin m)) <8n x float> each, lanes 8i..8i+7 block
    i's, exact. Groups 0-3: q[j] & 63, q[j+4] & 63; groups 4-7: (q[j+8] & 15) | (q[j] >> 6) << 4, (q[j+8] >> 4) |
    (q[j+4] >> 6) << 4: four bytes at once in 32-bit words (general-purpose registers' work, where the vector
    ports are the loop's bound), then one widening of the 8n bytes, one conversion and one multiply."""
    b, n = blocks[0].b, len(blocks)
    w, i64 = 8 * n, ir.IntType(64)
    c32 = lambda v: ir.Constant(I32, v)                                                 # noqa: E731
    sc, mn = ir.Constant(ir.VectorType(i64, n), ir.Undefined), ir.Constant(ir.VectorType(i64, n), ir.Undefined)
    dd = ir.Constant(ir.VectorType(I32, n), ir.Undefined)
    six = lambda word: b.and_(word, c32(0x3F3F3F3F))                                  # noqa: E731
    top = lambda word: b.and_(b.lshr(word, c32(2)), c32(0x30303030))                   # noqa: E731
    pack = lambda lo, hi: b.or_(b.zext(lo, i64), b.shl(b.zext(hi, i64), ir.Constant(i64, 32)))   # noqa: E731
    for i, k in enumerate(blocks):
        w0, w1, w2 = k.u32(4), k.u32(8), k.u32(12)
        s_hi = b.or_(b.and_(w2, c32(0x0F0F0F0F)), top(w0))
        m_hi = b.or_(b.and_(b.lshr(w2, c32(4)), c32(0x0F0F0F0F)), top(w1))
        sc = b.insert_element(sc, pack(six(w0), s_hi), c32(i))
        mn = b.insert_element(mn, pack(six(w1), m_hi), c32(i))
        dd = b.insert_element(dd, k.u32(0), c32(i))                                   # d, dmin: two float16s
    fw = ir.VectorType(F32, w)
    as_floats = lambda v: b.uitofp(b.zext(b.bitcast(v, ir.VectorType(I8, w)), ir.VectorType(I32, w)), fw)  # noqa
    h = b.fpext(b.bitcast(dd, ir.VectorType(F16, 2 * n)), ir.VectorType(F32, 2 * n))   # d0 dmin0 d1 dmin1 ...
    h = b.fmul(h, ir.Constant(ir.VectorType(F32, 2 * n), [1.0, -1.0] * n))              # d, -dmin: exact
    per = lambda at: _lanes(b, h, [2 * i + at for i in range(n) for _ in range(8)])     # noqa: E731
    return b.fmul(per(0), as_floats(sc)), b.fmul(per(1), as_floats(mn))


def _scaled(b, d, ints):
    """d (a float16's value) times each integer of a vector, in float32: exact (at most 11 x 8 bits)."""
    n = ints.type.count
    return b.fmul(_splat(b, d, n), b.sitofp(ints, ir.VectorType(F32, n)))


CODES16 = ir.Constant(VF, [float(j) for j in range(L)])         # the 16 values a 4-bit code takes


def _lookup(b, table, idx):
    """table[idx[l] & 15] in lane l: AVX-512's vpermps (a variable permute that reads the index's low four bits)."""
    name = "llvm.x86.avx512.permvar.sf.512"
    fn = b.module.globals.get(name) or ir.Function(b.module, ir.FunctionType(VF, [VF, VI32]), name=name)
    return b.call(fn, [table, idx])


def _codes_times(k, codes, scale, offset=None):
    """Weights scale * code + offset (scale, offset: <16 x float> splats, offset absent for 0) for 4-bit codes
    (<16 x i32> whose low four bits are the code), each rounded once: fma(code, scale, offset), exact where the
    oracle's product is (scale * code fits float32) and equal to its (scale * code) + offset otherwise. Where
    AVX-512's permute is at hand (TABLES) the sixteen values are computed once per scale and looked up."""
    b = k.b
    offset = offset if offset is not None else ir.Constant(VF, [0.0] * L)
    if TABLES:
        return _lookup(b, _fma(b, CODES16, scale, offset), codes)
    return _fma(b, k.fl(b.and_(codes, _vi(15))), scale, offset)


CENTRED16 = ir.Constant(VF, [float(j - 8) for j in range(L)])   # code - 8 for the 16 values a Q4_0 code takes


def _codes_centred(k, codes, d):
    """Q4_0's weights d * (code - 8) (d: a <16 x float> splat) for 4-bit codes as in _codes_times: exact in float32
    (an 11-bit float16 scale times a 4-bit integer), the oracle's value. With AVX-512's permute the sixteen values
    are one multiply a block (the constant codes - 8 times d), looked up per code."""
    b = k.b
    if TABLES:
        return _lookup(b, b.fmul(d, CENTRED16), codes)
    return b.fmul(d, k.fl(b.sub(b.and_(codes, _vi(15)), _vi(8))))


def _q3k_scales(k):
    """A Q3_K super-block's 16 scales less 32 (<16 x i32>, exact): scale j is byte j % 8's low (j < 8) or high four
    bits of the 12 bytes at 96, and bits 2 (j // 4).. of byte 8 + j % 4 above them (a 12-byte load, two shuffles)."""
    b = k.b
    v = b.bitcast(b.load(k.at(96, ir.VectorType(I32, 3)), align=1), ir.VectorType(I8, 12))
    lo = b.zext(_lanes(b, v, [j % 8 for j in range(L)]), VI32)
    hi = b.zext(_lanes(b, v, [8 + j % 4 for j in range(L)]), VI32)
    sc = b.or_(b.and_(b.lshr(lo, _vi([4 * (j // 8) for j in range(L)])), _vi(15)),
               b.shl(b.and_(b.lshr(hi, _vi([2 * (j // 4) for j in range(L)])), _vi(3)), _vi(4)))
    return b.sub(sc, _vi(32))


def _scale_vector(qtype, blocks):
    """The super-blocks' float scales, exact, for one or more blocks of a super-block type (`blocks`: one a row):
    Q4_K, Q5_K: <16n x float>, block r's d sc of group j in lane 8r + j, its -(dmin m) in lane 8n + 8r + j;
    Q2_K, Q3_K: <32n x float>, block r's scale of group j in lane 16r + j, its min term in 16n + 16r + j;
    Q6_K: <16n x float>, block r's d sc of group j in lane 16r + j."""
    if qtype == "Q6_K":                                 # row r's d sc in lanes 16r..
        return _joined(blocks[0].b, [_scaled(k.b, k.f16(208), k.bytes16(192, True)) for k in blocks])
    if qtype in ("Q2_K", "Q3_K"):
        b, scales, mins = blocks[0].b, [], []
        for k in blocks:
            if qtype == "Q2_K":                     # d (sc & 15), -(dmin (sc >> 4))
                sc = k.bytes16(0)
                scales.append(_scaled(b, k.f16(80), b.and_(sc, _vi(15))))
                mins.append(b.fsub(ir.Constant(VF, [-0.0] * L), _scaled(b, k.f16(82), b.lshr(sc, _vi(4)))))
            else:                                   # d (sc - 32), -4 d (sc - 32)
                scales.append(_scaled(b, k.f16(108), _q3k_scales(k)))
                mins.append(b.fmul(scales[-1], ir.Constant(VF, [-4.0] * L)))
        return _joined(b, scales + mins)
    return _joined(blocks[0].b, list(_k4_scales(blocks)))                                   # scales, then mins


def _scale_lane(qtype, r, n, j):
    """Where _scale_vector puts row r's (of n) scale j: Q4_K and Q5_K's j < 8 the group's d sc, 8 + g its min;
    Q2_K and Q3_K's j < 16 the group's scale, 16 + g its min term; Q6_K's j < 16 the group's d sc."""
    per = 16 if qtype in ("Q6_K", "Q2_K", "Q3_K") else 8                # groups a block (Q6_K: no min terms)
    return per * r + j if j < per else per * n + per * r + j - per


def _joined(b, vectors):
    """Equal-length vectors, a power of two of them (a tile's rows: 1, 2 or 4), one after another in one vector (a
    tree of shuffles)."""
    assert len(vectors) & (len(vectors) - 1) == 0, len(vectors)
    while len(vectors) > 1:
        n = vectors[0].type.count
        vectors = [b.shuffle_vector(vectors[i], vectors[i + 1], ir.Constant(ir.VectorType(I32, 2 * n),
                                                                           list(range(2 * n))))
                   for i in range(0, len(vectors), 2)]
    return vectors[0]


def _weights(qtype, k, splat=None):
    """One block at k -> [(w <16 x float>, x offset)]: its weights in float32, each the value gguf-py's
    dequantization (the NumPy oracle's) gives it, bit for bit: a float16 scale (times an integer sub-scale:
    exact) times a code (exact in float32 for every type), minus or plus a min term with one rounding. splat
    (super-block types): j -> lane j of the block's _scale_vector in every lane (default: decoded here)."""
    b = k.b
    if qtype in ("Q4_0", "Q4_1"):                           # lanes in LANE_ORDER's order
        q_at = 2 if qtype == "Q4_0" else 4
        codes = k.codes4(q_at, 16)
        lo, hi = codes(0, 0), codes(1, 0)
        if qtype == "Q4_0":
            d = k.f16_splats(0, 1)[0]
            return [(_codes_centred(k, lo, d), 0), (_codes_centred(k, hi, d), 16)]
        d, m = k.f16_splats(0, 2)
        return [(_codes_times(k, lo, d, m), 0), (_codes_times(k, hi, d, m), 16)]
    if qtype in ("Q5_0", "Q5_1"):
        h_at, q_at = (2, 6) if qtype == "Q5_0" else (4, 8)
        qh, q = k.u32(h_at), k.bytes16(q_at)
        lo = b.or_(_nibbles(k, q, 0), k.bits16(qh, 0))
        hi = b.or_(_nibbles(k, q, 4), k.bits16(qh, 16))
        if qtype == "Q5_0":
            d = k.f16_splats(0, 1)[0]
            return [(b.fmul(d, k.fl(b.sub(c, _vi(16)))), o) for c, o in ((lo, 0), (hi, 16))]
        d, m = k.f16_splats(0, 2)
        return [(_fma(b, k.fl(c), d, m), o) for c, o in ((lo, 0), (hi, 16))]
    if qtype == "Q8_0":
        d = k.f16_splats(0, 1)[0]
        return [(b.fmul(d, k.fl(k.bytes16(2, True))), 0), (b.fmul(d, k.fl(k.bytes16(18, True))), 16)]
    splat = splat or (k.splats(_scale_vector(qtype, [k])) if qtype in SCALE_VECTORS else None)
    if qtype in ("Q4_K", "Q5_K"):
        q_at, out = (16 if qtype == "Q4_K" else 48), []
        for j in range(8):
            base, shift = q_at + 32 * (j // 2), 4 * (j % 2)
            sv, mv = splat(j), splat(8 + j)
            if qtype == "Q4_K":                              # lanes in LANE_ORDER's order
                codes = k.codes4(base, 32)
                lo, hi = codes(j % 2, 0), codes(j % 2, 1)
                out += [(_codes_times(k, lo, sv, mv), 32 * j), (_codes_times(k, hi, sv, mv), 32 * j + 16)]
                continue
            lo, hi = _nibbles(k, k.bytes16(base), shift), _nibbles(k, k.bytes16(base + 16), shift)
            lo = b.or_(lo, b.shl(b.and_(b.lshr(k.bytes16(16), _vi(j)), _vi(1)), _vi(4)))   # qh[l] bit j: the
            hi = b.or_(hi, b.shl(b.and_(b.lshr(k.bytes16(32), _vi(j)), _vi(1)), _vi(4)))   # fifth bit
            out += [(_fma(b, k.fl(c), sv, mv), 32 * j + o) for c, o in ((lo, 0), (hi, 16))]
        return out
    if qtype == "Q6_K":
        out = []
        for n in range(2):
            for which in range(4):
                for h in range(2):
                    ql = _nibbles(k, k.bytes16(64 * n + 32 * (which % 2) + 16 * h), 4 * (which // 2))
                    qh = b.shl(b.and_(b.lshr(k.bytes16(128 + 32 * n + 16 * h), _vi(2 * which)), _vi(3)), _vi(4))
                    code = b.sub(b.or_(ql, qh), _vi(32))
                    s = splat(8 * n + h + 2 * which)
                    out.append((b.fmul(s, k.fl(code)), 128 * n + 32 * which + 16 * h))
        return out
    if qtype in ("Q2_K", "Q3_K"):       # 2-bit codes: byte l of 32-byte half h, bits 2j..2j+1 -> weight 128h + 32j + l
        out = []
        q_at = 16 if qtype == "Q2_K" else 32
        for h in range(2):
            for j in range(4):
                for half in range(2):
                    g, off = 8 * h + 2 * j + half, 128 * h + 32 * j + 16 * half
                    q = b.lshr(k.bytes16(q_at + 32 * h + 16 * half), _vi(2 * j))
                    q = b.and_(q, _vi(3)) if j < 3 else q                  # the top two bits need no mask
                    if qtype == "Q2_K":                  # dl q - ml, dl q exact: one rounding, as the oracle's
                        out.append((_fma(b, k.fl(q), splat(g), splat(16 + g)), off))
                        continue
                    s, hm = 4 * h + j, k.bytes16(16 * half)       # hmask bit s: 1 keeps the code, 0 takes 4 off
                    hb = b.lshr(hm, _vi(s - 2)) if s > 2 else b.shl(hm, _vi(2 - s)) if s < 2 else hm
                    c = b.or_(q, b.and_(hb, _vi(4)))                    # code + 4 hb, in 0..7: w = dl c - 4 dl,
                    out.append((_fma(b, k.fl(c), splat(g), splat(16 + g)), off))    # dl (c - 4) exact: the oracle's
        return out
    raise ValueError(f"no in-place kernel for {qtype}")


def _splats_from_memory(b, v, barrier=False):
    """_Block.splats by broadcast loads: v stored once to a stack slot, each lane read back by a load, which the
    backend folds into one vbroadcastss (or, with `barrier`, also into a fused multiply-add's broadcast operand).
    LLVM would otherwise forward the stored lane and shuffle: the loads are volatile, or with `barrier` plain ones
    behind an empty inline assembly block that is given the slot. Q4_K's two-row decode takes the barrier (its
    volatile loads make LLVM spill vectors: tools/kernel_ab.py 0.89-0.94x); Q5_K's and Q6_K's one-row decode the
    volatile loads (with the barrier 0.90x). A store read back by a broadcast load is forwarded on Zen 5 (11
    cycles, store and load, against 5 for a lane shuffle)."""
    with b.goto_entry_block():
        slot = b.alloca(v.type)
    b.store(v, slot, align=64)
    fp = b.bitcast(slot, F32.as_pointer())
    if barrier:
        b.call(ir.InlineAsm(ir.FunctionType(ir.VoidType(), [fp.type]), "", "r,~{memory}", side_effect=True), [fp])
        return lambda j: _splat(b, b.load(b.gep(fp, [ir.Constant(I32, j)]), align=4))

    def splat(j):
        load = _VolatileLoad(b.block, b.gep(fp, [ir.Constant(I32, j)]))
        b._insert(load)
        return _splat(b, load)
    return splat


class _VolatileLoad(ir.instructions.LoadInstr):
    """A load LLVM keeps (llvmlite's builder has no volatile loads)."""

    def descr(self, buf):
        [val] = self.operands
        buf.append(f"load volatile {self.type}, {val.type} {val.get_reference()}, align 4\n")


def _splat(b, v, n=L):
    """A float32 scalar in every lane of a <n x float>."""
    u = ir.Constant(ir.VectorType(F32, n), ir.Undefined)
    return b.shuffle_vector(b.insert_element(u, v, ir.Constant(I32, 0)), u, ir.Constant(ir.VectorType(I32, n), [0] * n))


def _hsum(b, v):
    """A vector's lanes summed as a fixed tree (halves added, then their halves, ...)."""
    n = v.type.count
    while n > 1:
        n //= 2
        t = ir.VectorType(F32, n)
        lo = b.shuffle_vector(v, v, ir.Constant(ir.VectorType(I32, n), list(range(n))))
        hi = b.shuffle_vector(v, v, ir.Constant(ir.VectorType(I32, n), list(range(n, 2 * n))))
        v = b.fadd(lo, hi)
        assert v.type == t
    return b.extract_element(v, ir.Constant(I32, 0))


def _fma(b, a, x, c):
    """a * x + c rounded once (llvm.fma: a fused multiply-add where the CPU has one), for float vectors."""
    n = a.type.count
    name = f"llvm.fma.v{n}f32"
    fn = b.module.globals.get(name) or ir.Function(b.module, ir.FunctionType(a.type, [a.type] * 3), name=name)
    return b.call(fn, [a, x, c])


def _prefetch(b, ptr):
    """A hint to bring ptr's cache line in (read, kept in every cache level); no effect on any value."""
    fnty = ir.FunctionType(ir.VoidType(), [I8.as_pointer(), I32, I32, I32])
    fn = b.module.globals.get("llvm.prefetch.p0") or ir.Function(b.module, fnty, name="llvm.prefetch.p0")
    b.call(fn, [ptr, ir.Constant(I32, 0), ir.Constant(I32, 3), ir.Constant(I32, 1)])


def _block_loop(b, n_blocks, init, body):
    """for i in range(n_blocks): state = body(i, state), the state a dict of IR values starting at the constants
    `init` -> the final state. One basic block with phis (LLVM's form of a loop-carried value); none run when
    n_blocks is 0."""
    entry, loop, done = b.block, b.append_basic_block("blocks"), b.append_basic_block("blocks_done")
    b.cbranch(b.icmp_signed(">", n_blocks, ir.Constant(I64, 0)), loop, done)
    b.position_at_end(loop)
    i = b.phi(I64)
    phis = {k: b.phi(v.type) for k, v in init.items()}
    i.add_incoming(ir.Constant(I64, 0), entry)
    for k, v in init.items():
        phis[k].add_incoming(v, entry)
    new = body(i, dict(phis))
    i2, tail = b.add(i, ir.Constant(I64, 1)), b.block
    i.add_incoming(i2, tail)
    for k in init:
        phis[k].add_incoming(new[k], tail)
    b.cbranch(b.icmp_signed("<", i2, n_blocks), loop, done)
    b.position_at_end(done)
    out = {}
    for k, v in init.items():
        out[k] = b.phi(v.type)
        out[k].add_incoming(v, entry)
        out[k].add_incoming(new[k], tail)
    return out


def _pointers(b, addr, n):
    """n byte pointers read from the int64 addresses at addr."""
    p = b.inttoptr(addr, I64.as_pointer())
    return [b.inttoptr(b.load(b.gep(p, [ir.Constant(I64, r)])), I8.as_pointer()) for r in range(n)]


def _strided(b, addr, stride, n, ty):
    """Pointers to rows 0..n-1 of an array of `ty` at addr, `stride` elements apart."""
    return [b.gep(b.inttoptr(addr, ty.as_pointer()), [b.mul(stride, ir.Constant(I64, t))]) for t in range(n)]


def _block_at(b, row, ahead, i, block_bytes):
    """Block i of a row, after prefetching block i of the row to come (every cache line of it)."""
    at = b.mul(i, ir.Constant(I64, block_bytes))
    for line in range(0, block_bytes, 64):
        _prefetch(b, b.gep(ahead, [b.add(at, ir.Constant(I64, line))]))
    return _Block(b, b.gep(row, [at]))


def _emit_tile(b, qtype, n_rows, tokens, rowsa, aheada, xa, x_stride, outa, out_stride, n_blocks):
    """The loop over the blocks of n_rows rows (their addresses: int64s at rowsa) for `tokens` tokens at once;
    stores out[t * out_stride + r]. As it goes, it prefetches the same blocks of the n_rows rows at aheada (the
    rows a thread takes next: DRAM's latency hidden where the hardware's prefetchers stop at page ends). Each
    block's weights are made once (_weights) for the tile's tokens; each (row, token) has its own accumulators,
    ACCUMULATORS of them taking a block's 16-weight segments in turn (so that one block's fused multiply-adds do
    not wait on each other), every one updated by the same operations in the same order whatever the tile: a
    product's value does not depend on its tile.
    For one token, a super-block type's scales (SCALE_VECTORS) are decoded for the tile's rows in one pass and
    splatted by broadcast loads; on AVX-512 builds (SCALES_AHEAD) an iteration ahead, first in the body, and carried
    to the next: the chain from the scale bytes to the weights' tables (integer decode, conversion,
    a store and broadcast loads: about 45 cycles) otherwise held each iteration's lookups and multiply-adds
    waiting, with the out-of-order window too small to start the next one (tools/kernel_ab.py on AMD EPYC Zen 5,
    weights from DRAM: Q4_K 1.08-1.10x, Q5_K 1.14x, Q6_K 1.11-1.14x, the same products to the bit). The last
    iteration decodes its own block again, never a block past the row's end."""
    block_len, block_bytes = BLOCKS[qtype]
    step = SUPER_ROWS.get(qtype, n_rows) if tokens == 1 else n_rows
    if step < n_rows:                               # super-blocks of several rows at once spill registers: loops
        for r0 in range(0, n_rows, step):           # of fewer rows (the same operations per row)
            at = ir.Constant(I64, 8 * r0)
            _emit_tile(b, qtype, min(step, n_rows - r0), 1, b.add(rowsa, at), b.add(aheada, at), xa, x_stride,
                       b.add(outa, ir.Constant(I64, 4 * r0)), out_stride, n_blocks)
        return
    n_acc = ACCUMULATORS[block_len]
    rows, later = _pointers(b, rowsa, n_rows), _pointers(b, aheada, n_rows)
    xp = _strided(b, xa, x_stride, tokens, F32)
    keys = [(r, t) for r in range(n_rows) for t in range(tokens)]
    init = {("acc", r, t, a): ir.Constant(VF, [0.0] * L) for r, t in keys for a in range(n_acc)}
    joint = tokens == 1 and qtype in SCALE_VECTORS     # one token: the rows' scales decoded in one pass, splatted
    ahead = joint and SCALES_AHEAD                      # by broadcast loads; an iteration ahead (see above)
    scales_of = lambda i: _scale_vector(qtype, [_Block(b, b.gep(row, [b.mul(i, ir.Constant(I64, block_bytes))]))
                                                for row in rows])          # noqa: E731
    if ahead:
        init["scales"] = scales_of(ir.Constant(I64, 0))

    def body(i, st):
        x0, xv = b.mul(i, ir.Constant(I64, block_len)), {}     # x's 16 floats at an offset: loaded once
        if ahead:
            nxt = b.add(i, ir.Constant(I64, 1))
            next_scales = scales_of(b.select(b.icmp_signed("<", nxt, n_blocks), nxt, i))

        def x_at(t, off):
            if (t, off) not in xv:
                ptr = b.gep(xp[t], [b.add(x0, ir.Constant(I64, off))])
                xv[t, off] = b.load(b.bitcast(ptr, VF.as_pointer()), align=4)
            return xv[t, off]
        blocks = [_block_at(b, rows[r], later[r], i, block_bytes) for r in range(n_rows)]
        if joint:
            splat = _splats_from_memory(b, st["scales"] if ahead else scales_of(i), barrier=qtype not in SPLAT_LOADS)
        if ahead:
            st["scales"] = next_scales
        for r in range(n_rows):
            row_splat = (lambda j, r=r: splat(_scale_lane(qtype, r, n_rows, j))) if joint else None
            for w, off in _weights(qtype, blocks[r], row_splat):
                for t in range(tokens):
                    key = ("acc", r, t, off // L % n_acc)
                    st[key] = _fma(b, w, x_at(t, off), st[key])
        return st

    _store_sums(b, _block_loop(b, n_blocks, init, body), keys, n_acc, outa, out_stride)


def _store_sums(b, end, keys, n_acc, outa, out_stride):
    """out[t * out_stride + r] = the sum of (row r, token t)'s n_acc lane accumulators in end: a fixed tree."""
    outp = b.inttoptr(outa, F32.as_pointer())
    for r, t in keys:
        acc = [end["acc", r, t, a] for a in range(n_acc)]
        while len(acc) > 1:                                     # (a0 + a1) + (a2 + a3): a fixed tree
            acc = [b.fadd(acc[j], acc[j + 1]) for j in range(0, len(acc), 2)]
        at = b.add(b.mul(out_stride, ir.Constant(I64, t)), ir.Constant(I64, r))
        b.store(_hsum(b, acc[0]), b.gep(outp, [at]))


def _emit_weights(b, qtype, n_rows, rowsa, aheada, wa, w_stride, first, n_blocks):
    """The weights of blocks first.. first + n_blocks - 1 of n_rows rows (their blocks' addresses: int64s at rowsa)
    as float32, each _weights' value, into w[r * w_stride:], in x's lane order (_weights' offsets), prefetching the
    same blocks of the rows at aheada as _emit_tile does."""
    block_len, block_bytes = BLOCKS[qtype]
    rows, later = _pointers(b, rowsa, n_rows), _pointers(b, aheada, n_rows)
    wp = _strided(b, wa, w_stride, n_rows, F32)

    def body(i, st):
        x0 = b.mul(i, ir.Constant(I64, block_len))
        for r in range(n_rows):
            for w, off in _weights(qtype, _block_at(b, rows[r], later[r], b.add(first, i), block_bytes)):
                ptr = b.gep(wp[r], [b.add(x0, ir.Constant(I64, off))])
                b.store(w, b.bitcast(ptr, VF.as_pointer()), align=4)
        return st
    _block_loop(b, n_blocks, {}, body)


def _emit_float_tile(b, n_acc, n_rows, tokens, wa, w_stride, xa, x_stride, acca, acc_stride, first, last, outa,
                     out_stride, n_groups, passes=False):
    """_emit_tile's products from weights made already (_emit_weights: float32 rows at wa, w_stride apart), n_groups
    groups of n_acc 16-weight segments: the same fused multiply-adds into the same accumulators in the same order
    (_weights gives every type's segments in the order of their offsets, segment s to accumulator s % n_acc), so the
    same products to the bit; the weights' decoding is paid once for every token a call carries instead of once per
    tile. For a row cut in chunks: the accumulators start from those stored at acca (row r, token t's at
    (t acc_stride + r) * 64 floats) unless `first`, and are stored there again unless `last` (then summed into out
    by _store_sums' tree): stored and loaded exactly, the same sums. With `passes`, one accumulator at a time: pass a
    runs accumulator a of every (row, token) over its segments in their order and stores it (n_acc times fewer
    registers live: tiles of more rows and tokens)."""
    wp, xp = _strided(b, wa, w_stride, n_rows, F32), _strided(b, xa, x_stride, tokens, F32)
    keys = [(r, t) for r in range(n_rows) for t in range(tokens)]
    load = lambda p, at: b.load(b.bitcast(b.gep(p, [at]), VF.as_pointer()), align=4)     # noqa: E731
    accp = b.inttoptr(acca, F32.as_pointer())
    slot = lambda r, t, a: b.bitcast(b.gep(accp, [b.add(b.mul(b.add(b.mul(acc_stride, ir.Constant(I64, t)),   # noqa
                                     ir.Constant(I64, r)), ir.Constant(I64, 64)), ir.Constant(I64, L * a))]),
                                     VF.as_pointer())
    zero = ir.Constant(VF, [0.0] * L)
    groups = [[a] for a in range(n_acc)] if passes else [list(range(n_acc))]
    for g, accs in enumerate(groups):
        init = {("acc", r, t, a): b.select(first, zero, b.load(slot(r, t, a), align=4)) for r, t in keys for a in accs}

        def body(i, st, accs=accs):
            for a in accs:
                at = b.add(b.mul(i, ir.Constant(I64, L * n_acc)), ir.Constant(I64, L * a))
                ws, xs = [load(p, at) for p in wp], [load(p, at) for p in xp]
                for r, t in keys:
                    st["acc", r, t, a] = _fma(b, ws[r], xs[t], st["acc", r, t, a])
            return st
        end = _block_loop(b, n_groups, init, body)

        def store(end=end, accs=accs):
            for r, t in keys:
                for a in accs:
                    b.store(end["acc", r, t, a], slot(r, t, a), align=4)
        if g < len(groups) - 1:
            store()
            continue
        with b.if_else(last) as (summed, kept):
            with summed:
                stored = {("acc", r, t, a): b.load(slot(r, t, a), align=4) for r, t in keys
                          for a in range(n_acc) if a not in accs}
                _store_sums(b, {**stored, **end}, keys, n_acc, outa, out_stride)
            with kept:
                store()


def _panel_tiles(module, n_acc, n_rows):
    """One chunk's float tiles over every token, as a function of the module (made once, called by every type's
    panel: the tiles depend on the accumulators a (row, token) has, not on the type): (w, w_stride, x, x_stride,
    acc, first, last, T, out, out_stride, n_groups) -> PANEL_TILE's tiles over the tokens in groups, n_rows-row
    tiles for the tokens left over (_emit_float_tile)."""
    name = f"llorch_panel_tiles_{n_acc}_{n_rows}"
    if name in module.globals:
        return module.globals[name]
    bit = ir.IntType(1)
    fn = ir.Function(module, ir.FunctionType(ir.VoidType(), [I64] * 5 + [bit, bit] + [I64] * 4), name=name)
    fn.linkage = "internal"
    fn.attributes.add("noinline")
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    wa, w_stride, xa, x_stride, acca, first, last, n_tokens, outa, out_stride, n_groups = fn.args
    rows, tokens, passes = PANEL_TILE[n_acc]
    i64 = lambda v: ir.Constant(I64, v)                                              # noqa: E731
    at = lambda base, elems: b.add(base, b.mul(elems, i64(4)))                       # noqa: E731

    def group(t, st, tokens=tokens, rows=rows):
        for r in range(0, n_rows, rows):
            _emit_float_tile(b, n_acc, rows, tokens, at(wa, b.mul(w_stride, i64(r))), w_stride,
                             at(xa, b.mul(t, x_stride)), x_stride,
                             at(acca, b.mul(b.add(b.mul(t, i64(n_rows)), i64(r)), i64(64))), i64(n_rows),
                             first, last, at(outa, b.add(b.mul(t, out_stride), i64(r))), out_stride, n_groups,
                             passes)
        return st
    full = b.sub(n_tokens, b.srem(n_tokens, i64(tokens)))
    _counted_loop(b, full, tokens, {}, group)
    _block_loop(b, b.sub(n_tokens, full), {}, lambda j, st: group(b.add(full, j), st, tokens=1, rows=n_rows))
    b.ret_void()
    return fn


def _emit_panel(b, qtype, n_rows, rowsa, aheada, wa, acca, xa, x_stride, n_tokens, outa, out_stride, n_blocks):
    """Every token's products with n_rows rows (their blocks' addresses at rowsa; aheada: the rows to prefetch), in
    chunks (PANEL_CHUNK): each chunk's weights made once into w (_emit_weights), then the chunk's float tiles over
    every token (_panel_tiles); between chunks each (row, token)'s accumulators wait in acc (for n_tokens tokens:
    [n_tokens * n_rows, 64] floats)."""
    block_len = BLOCKS[qtype][0]
    n_acc = ACCUMULATORS[block_len]
    tiles = _panel_tiles(b.module, n_acc, n_rows)
    i64 = lambda v: ir.Constant(I64, v)                                              # noqa: E731
    whole, part = (i64(n // block_len) for n in PANEL_CHUNK)
    per = b.select(b.icmp_signed(">", n_blocks, whole), part, whole)                # blocks a chunk
    w_stride = b.mul(b.select(b.icmp_signed("<", n_blocks, per), n_blocks, per), i64(block_len))
    n_chunks = b.sdiv(b.add(n_blocks, b.sub(per, i64(1))), per)

    def chunk(c, st):
        first_block = b.mul(c, per)
        count = b.sub(n_blocks, first_block)
        count = b.select(b.icmp_signed("<", count, per), count, per)
        _emit_weights(b, qtype, n_rows, rowsa, aheada, wa, w_stride, first_block, count)
        first, last = b.icmp_signed("==", c, i64(0)), b.icmp_signed("==", c, b.sub(n_chunks, i64(1)))
        x_chunk = b.add(xa, b.mul(first_block, i64(4 * block_len)))
        b.call(tiles, [wa, w_stride, x_chunk, x_stride, acca, first, last, n_tokens, outa, out_stride,
                       b.mul(count, i64(block_len // (L * n_acc)))])
        return st
    _block_loop(b, n_chunks, {}, chunk)


NAMES = tuple(BLOCKS)
TYPE_CODE = {name: i for i, name in enumerate(NAMES)}


def _lane_order(qtype) -> list:
    """For each of 32 weights in _weights' order, its place in its group of 32 in the file: the 4-bit types' codes
    come in _Block.codes4's order with WORDS, the others' in the file's."""
    if qtype in ("Q4_0", "Q4_1") and WORDS:
        return [16 * h + 4 * (lane % 4) + lane // 4 for h in range(2) for lane in range(L)]
    if qtype == "Q4_K" and WORDS:
        return [4 * (lane % 8) + lane // 8 + 2 * m for m in range(2) for lane in range(L)]
    return list(range(32))


LANE_ORDER = np.array([_lane_order(name) for name in NAMES], np.int64)   # [type code, 32]: x read in this order
REORDERED = np.array([_lane_order(name) != list(range(32)) for name in NAMES])
SUPER = np.array([BLOCKS[name][0] == 256 for name in NAMES], np.int64)          # 1 for the super-block types


def _per_type(b, code, names, emit):
    """A switch on the runtime type code: emit(name) for each of `names`, then on to one merge block."""
    merge = b.append_basic_block("type_done")
    switch = b.switch(code, merge)
    for name in names:
        case = b.append_basic_block(f"type_{name}")
        switch.add_case(ir.Constant(code.type, TYPE_CODE[name]), case)
        b.position_at_end(case)
        emit(name)
        b.branch(merge)
    b.position_at_end(merge)


def _tile(code, literals, n_addr, names, emit, arrays=()):
    """A tile intrinsic's typing: literal integers (R, T, ...), then n_addr integer arguments (addresses, strides,
    counts) -> (signature, codegen): a switch on the runtime type code over `names`, each emit(builder, name,
    *the literals' values, *the n_addr values); a literal type code (a kernel made for one type:
    numba_kernels.matmul_rows_for) emits that type's loop alone. `arrays`: the tail's arguments (by their place in
    it) that are float32 arrays, given to emit as their data's address (an argument to the call keeps the array
    alive through it)."""
    if not all(isinstance(a, types.IntegerLiteral) for a in literals):
        return None
    consts = [a.literal_value for a in literals]
    if isinstance(code, types.IntegerLiteral):
        names = tuple(n for n in names if TYPE_CODE[n] == code.literal_value)
        if not names:
            return None
    skip = 1 + len(literals)
    tail = [types.Array(types.float32, 2, "C") if i in arrays else types.intp for i in range(n_addr)]

    def codegen(context, builder, signature, args):
        vals = [builder.ptrtoint(context.make_array(ty)(context, builder, v).data, I64) if i in arrays else v
                for i, (ty, v) in enumerate(zip(tail, args[skip:]))]
        if isinstance(signature.args[0], types.IntegerLiteral):
            emit(builder, names[0], *consts, *vals)
        else:
            _per_type(builder, args[0], names, lambda name: emit(builder, name, *consts, *vals))
        return context.get_dummy_value()
    return types.void(code, *literals, *tail), codegen


@intrinsic
def dot_tile(typingctx, code, n_rows, n_tokens, rowsa, aheada, xa, x_stride, outa, out_stride, n_blocks):
    """dot_tile(code, R, T, rows, ahead, x, x_stride, out, out_stride, n_blocks), code = TYPE_CODE[qtype] (a switch
    over every type's loop), R and T constants: out[t * out_stride + r] = row r's dot product with
    x[t * x_stride:] for r < R, t < T (addresses as integers, strides in elements; rows: the address of R int64
    row addresses; ahead: R more, the rows to prefetch)."""
    return _tile(code, (n_rows, n_tokens), 7, NAMES, _emit_tile)


@intrinsic
def panel_times(typingctx, code, n_rows, rowsa, aheada, w, acc, xa, x_stride, n_tokens, outa, out_stride, n_blocks):
    """panel_times(code, R, rows, ahead, w, acc, x, x_stride, T, out, out_stride, n_blocks): out[t * out_stride + r]
    for r < R, t < T (_emit_panel): dot_tile's products, the same to the bit. w: a float32 [R, a chunk's weights]
    array (K up to PANEL_CHUNK[0], else PANEL_CHUNK[1]); acc: a float32 [T R, 64] one where K > PANEL_CHUNK[0]
    (else any)."""
    return _tile(code, (n_rows,), 10, NAMES, _emit_panel, arrays=(2, 3))


# -- ggml's integer products, bit for bit (numerics "ggml"): the legacy types' codes times Q8 activations -----
LEGACY = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")


def _legacy_codes(qtype, k):
    """One legacy block at k -> (codes of elements 0-15, of 16-31: <16 x i32> integers as ggml unpacks them,
    d, m or None: float32)."""
    b = k.b
    if qtype == "Q8_0":
        return k.bytes16(2, True), k.bytes16(18, True), k.f16(0), None
    q_at, h_at = {"Q4_0": (2, None), "Q4_1": (4, None), "Q5_0": (6, 2), "Q5_1": (8, 4)}[qtype]
    q = k.bytes16(q_at)
    lo, hi = _nibbles(k, q, 0), _nibbles(k, q, 4)
    if h_at is not None:
        qh = k.u32(h_at)
        lo, hi = b.or_(lo, k.bits16(qh, 0)), b.or_(hi, k.bits16(qh, 16))
    off = {"Q4_0": 8, "Q5_0": 16}.get(qtype)
    if off:
        lo, hi = b.sub(lo, _vi(off)), b.sub(hi, _vi(off))
    return lo, hi, k.f16(0), (k.f16(2) if qtype in ("Q4_1", "Q5_1") else None)


PAIRS = _compiles_for("avx2")      # ggml's integer products from bytes (vpmaddubsw, vpmaddwd) or as 32-bit products
VNNI = _compiles_for("avxvnni") or (_compiles_for("avx512vnni") and _compiles_for("avx512vl"))    # vpdpbusd
V32I8, V8I32, V16I16 = ir.VectorType(I8, 32), ir.VectorType(I32, 8), ir.VectorType(I16, 16)
# A legacy type's codes as unsigned bytes and the offset ggml subtracts (Q8_0: signed bytes, None)
LEGACY_BYTES = {"Q4_0": (2, None, 8), "Q4_1": (4, None, 0), "Q5_0": (6, 2, 16), "Q5_1": (8, 4, 0)}


def _call(b, name, ret, args):
    """A call of the LLVM intrinsic `name` (declared once per module)."""
    fn = b.module.globals.get(name) or ir.Function(b.module, ir.FunctionType(ret, [a.type for a in args]), name=name)
    return b.call(fn, args)


def _bytes(v):
    return ir.Constant(V32I8, [v] * 32)


def _dot_bytes(b, u, s, base):
    """<32 x i8> u (unsigned), s (signed) -> base + <8 x i32>: lane l the sum of u[j] * s[j] over j = 4l..4l+3,
    exact: one vpdpbusd (VNNI), or vpmaddubsw then vpmaddwd (its 16-bit pair sums stay below 2^15 for every caller:
    codes below 64 times activations within +-127, or |Q8_0 codes| <= 128 times them), or below AVX2 32-bit
    products (_quad_sums)."""
    if not PAIRS:
        halves = [ir.Constant(ir.VectorType(I32, 16), list(range(h, h + 16))) for h in (0, 16)]
        us = [b.zext(b.shuffle_vector(u, u, h), VI32) for h in halves]
        ss = [b.sext(b.shuffle_vector(s, s, h), VI32) for h in halves]
        return b.add(base, _quad_sums(b, us[0], us[1], ss[0], ss[1]))
    if VNNI:
        return _call(b, "llvm.x86.avx512.vpdpbusd.256", V8I32, [base, b.bitcast(u, V8I32), b.bitcast(s, V8I32)])
    pairs = _call(b, "llvm.x86.avx2.pmadd.ub.sw", V16I16, [u, s])
    return b.add(base, _call(b, "llvm.x86.avx2.pmadd.wd", V8I32, [pairs, ir.Constant(V16I16, [1] * 16)]))


def _legacy_bytes(qtype, k):
    """One legacy block at k -> (<32 x i8> codes, d, m or None): Q4_*/Q5_* codes unsigned (element j's value
    code - LEGACY_BYTES' offset), Q8_0's signed, as the file holds them."""
    b = k.b
    if qtype == "Q8_0":
        return b.load(k.at(2, V32I8), align=1), k.f16(0), None
    q_at, h_at, _ = LEGACY_BYTES[qtype]
    q = b.load(k.at(q_at, VI8), align=1)
    codes = b.shuffle_vector(b.and_(q, ir.Constant(VI8, [15] * 16)), b.lshr(q, ir.Constant(VI8, [4] * 16)),
                             ir.Constant(ir.VectorType(I32, 32), list(range(32))))
    if h_at is not None:                    # element j's fifth bit: bit j of the 32-bit qh
        bits = b.zext(b.bitcast(k.u32(h_at), ir.VectorType(ir.IntType(1), 32)), V32I8)
        codes = b.or_(codes, b.shl(bits, _bytes(4)))
    return codes, k.f16(0), (k.f16(2) if qtype in ("Q4_1", "Q5_1") else None)


def _quad_sums(b, lo, hi, alo, ahi):
    """Codes and activations of elements 0-15 and 16-31 as <16 x i32> -> <8 x i32>: lane l the sum of the
    products of elements 4l..4l+3 (exact): the path of CPUs without AVX2."""
    p_lo, p_hi, s = b.mul(lo, alo), b.mul(hi, ahi), None
    for j in range(4):
        v = b.shuffle_vector(p_lo, p_hi, ir.Constant(ir.VectorType(I32, 8), [4 * lane + j for lane in range(8)]))
        s = v if s is None else b.add(s, v)
    return s


def _ggml_block(b, qtype, k, acts):
    """One block of a row by each token's Q8 activations -> (per token <8 x i32> exact lane sums, d, m). acts:
    _ggml_acts' per token tuples."""
    if not PAIRS:
        lo, hi, d, m = _legacy_codes(qtype, k)
        return [_quad_sums(b, lo, hi, a[0], a[1]) for a in acts], d, m
    codes, d, m = _legacy_bytes(qtype, k)
    if qtype == "Q8_0":                     # ggml's sign trick: |w| * (a signed as w), exact
        u = _call(b, "llvm.abs.v32i8", V32I8, [codes, ir.Constant(ir.IntType(1), 0)])
        return [_dot_bytes(b, u, _call(b, "llvm.x86.avx2.psign.b", V32I8, [a[0], codes]), ir.Constant(V8I32, [0] * 8))
                for a in acts], d, m
    return [_dot_bytes(b, codes, a[0], a[1]) for a in acts], d, m


def _ggml_acts(b, qtype, qa):
    """One token's 32 Q8 activations at qa -> PAIRS: (<32 x i8>, -offset * their quad sums: the start of a dot
    with codes stored offset); else their two halves as <16 x i32>."""
    if not PAIRS:
        return (b.sext(b.load(b.bitcast(qa, VI8.as_pointer()), align=1), VI32),
                b.sext(b.load(b.bitcast(b.gep(qa, [ir.Constant(I64, 16)]), VI8.as_pointer()), align=1), VI32))
    a = b.load(b.bitcast(qa, V32I8.as_pointer()), align=1)
    off = LEGACY_BYTES.get(qtype, (0, 0, 0))[2]
    zero = ir.Constant(V8I32, [0] * 8)
    return a, (b.sub(zero, _dot_bytes(b, _bytes(off), a, zero)) if off else zero)


def _kquant_codes(b, qtype, blk, g):
    """Group g (elements 32g..32g+31) of a Q4_K, Q5_K or Q6_K super-block at i8* blk -> its 32 codes as unsigned
    bytes (ggml_cpu.k_codes' values: Q5_K 0..31, Q6_K 0..63 with its -32 left to the block sums; Q2_K 0..3, Q3_K
    0..7, its code + 4)."""
    load = lambda at: b.load(_Block(b, blk).at(at, V32I8), align=1)                                     # noqa
    shr = lambda v, n: b.lshr(v, _bytes(n)) if n else v                                                 # noqa
    low = lambda v: b.and_(v, _bytes(15))                                                                # noqa
    if qtype == "Q6_K":
        j, part = divmod(g, 4)
        ql, h = load(64 * j + 32 * (part & 1)), load(128 + 32 * j)
        return b.or_(low(ql) if part < 2 else shr(ql, 4), b.shl(b.and_(shr(h, 2 * part), _bytes(3)), _bytes(4)))
    if qtype in ("Q2_K", "Q3_K"):             # bits 2k.. of the 32 bytes of half j; Q3_K: + 4 (hmask bit g)
        j, part = divmod(g, 4)
        q = b.and_(shr(load((16 if qtype == "Q2_K" else 32) + 32 * j), 2 * part), _bytes(3))
        return q if qtype == "Q2_K" else b.or_(q, b.shl(b.and_(shr(load(0), g), _bytes(1)), _bytes(2)))
    q = load((16 if qtype == "Q4_K" else 48) + 32 * (g // 2))
    codes = shr(q, 4) if g % 2 else low(q)
    if qtype == "Q5_K":                       # the fifth bit: bit g of qh[i]
        codes = b.or_(codes, b.shl(b.and_(shr(load(16), g), _bytes(1)), _bytes(4)))
    return codes


KQUANT = ("Q4_K", "Q5_K", "Q6_K", "Q2_K", "Q3_K")


def _i32s(b, v8, idx):
    """Lanes idx of an integer vector, as an <len(idx) x i32>."""
    return b.shuffle_vector(v8, v8, ir.Constant(ir.VectorType(I32, len(idx)), list(idx)))


def _k_scales_ir(b, qtype, blk):
    """A super-block's scales as int32 vectors: Q4_K, Q5_K -> (<8> scales, <8> mins) (get_scale_min_k4); Q6_K ->
    (<16> signed scales, None)."""
    at = lambda off, n: b.load(_Block(b, blk).at(off, ir.VectorType(I8, n)), align=1)    # noqa: E731
    if qtype == "Q6_K":
        return b.sext(at(192, 16), ir.VectorType(I32, 16)), None
    if qtype == "Q2_K":                                 # (<16> sc & 15, <16> sc >> 4)
        sc = b.zext(at(0, 16), VI32)
        return b.and_(sc, _vi(15)), b.lshr(sc, _vi(4))
    if qtype == "Q3_K":
        return _q3k_scales(_Block(b, blk)), None
    v = b.zext(at(4, 16), ir.VectorType(I32, 16))      # bytes a = 0..3, m = 4..7, c = 8..11 (12..15: codes, unread)
    c4 = lambda v_: ir.Constant(ir.VectorType(I32, 4), [v_] * 4)    # noqa: E731
    a, m, c = _i32s(b, v, range(0, 4)), _i32s(b, v, range(4, 8)), _i32s(b, v, range(8, 12))
    hi_s = b.or_(b.and_(c, c4(15)), b.shl(b.lshr(a, c4(6)), c4(4)))
    hi_m = b.or_(b.lshr(c, c4(4)), b.shl(b.lshr(m, c4(6)), c4(4)))
    join = ir.Constant(ir.VectorType(I32, 8), list(range(8)))
    return (b.shuffle_vector(b.and_(a, c4(63)), hi_s, join), b.shuffle_vector(b.and_(m, c4(63)), hi_m, join))


@intrinsic
def kquant_block(typingctx, code, n_tokens, blk_a, qa_a, q8s_a, bsums_a, da_a, acc_a, accm_a, n_blocks):
    """kquant_block(code, T, blk, qa, q8s, bsums, da, acc, accm, NB): one Q2_K..Q6_K super-block (code:
    TYPE_CODE; at address blk; its codes decoded once) times T tokens' Q8_K blocks (T a constant; token t's: qa + t *
    256 NB (256 int8), q8s + t * 8 NB (its 8 group sums) and bsums + t * 16 NB (its 16 sums), int32, da + t * NB (its
    scale, float32)), into token t's acc + 8 t (8 float32) and accm + 4 t (4 float32; Q5_K: accm[0] its summs) as
    ggml_cpu.KQuantMatrix does: integer lanes (the codes' group dots by _dot_bytes times each group's scale; Q6_K less
    32 times its block sums' scaled pairs; Q3_K's codes + 4 less 4 times the activations), acc = fma(da * d, lanes,
    acc), Q4_K's mins through 4 lanes (fma(-da * dmin, ...)), Q5_K's one sum, Q2_K's mins into acc first, each FMA
    ggml_cpu's float64 emulation."""
    if not isinstance(n_tokens, types.IntegerLiteral):
        return None
    tokens = n_tokens.literal_value

    def codegen(context, builder, signature, args):
        b = builder
        blk, nb_ = b.inttoptr(args[2], I8.as_pointer()), args[9]
        at = lambda arg, ty, per, t: b.gep(b.inttoptr(args[arg], ty.as_pointer()),      # noqa: E731
                                           [b.mul(nb_, ir.Constant(I64, per * t))])
        V4F, V8F = ir.VectorType(F32, 4), ir.VectorType(F32, 8)
        zero, k = ir.Constant(V8I32, [0] * 8), _Block(b, blk)

        def pairs(t, per16):
            """<8 x i32>: lane l bsums[2l] per16[2l] + bsums[2l+1] per16[2l+1], token t's block sums (exact)."""
            bs = b.load(b.bitcast(at(5, I32, 16, t), ir.VectorType(I32, 16).as_pointer()), align=4)
            even, odd = range(0, 16, 2), range(1, 16, 2)
            return b.add(b.mul(_i32s(b, bs, even), _i32s(b, per16, even)),
                         b.mul(_i32s(b, bs, odd), _i32s(b, per16, odd)))

        def emit(qtype):
            scales, mins = _k_scales_ir(b, qtype, blk)
            sumi = [zero] * tokens
            halves = qtype in ("Q6_K", "Q2_K", "Q3_K")        # a scale per 16 elements: lanes 0-3, 4-7
            for g in range(8):
                c = _kquant_codes(b, qtype, blk, g)
                sg = _i32s(b, scales, [2 * g] * 4 + [2 * g + 1] * 4) if halves else _i32s(b, scales, [g] * 8)
                for t in range(tokens):
                    a = b.load(b.bitcast(b.gep(at(3, I8, 256, t), [ir.Constant(I64, 32 * g)]), V32I8.as_pointer()),
                               align=1)
                    base = b.sub(zero, _dot_bytes(b, _bytes(4), a, zero)) if qtype == "Q3_K" else zero   # code - 4
                    sumi[t] = b.add(sumi[t], b.mul(_dot_bytes(b, c, a, base), sg))
            d = k.f16({"Q6_K": 208, "Q2_K": 80, "Q3_K": 108}.get(qtype, 0))
            dmin = k.f16(2) if qtype in ("Q4_K", "Q5_K") else None
            for t in range(tokens):
                da_ = b.load(at(6, F32, 1, t))
                if qtype == "Q2_K":             # its mins first, into acc: lane l m[2l] bsums[2l] + m[2l+1] bsums[2l+1]
                    accp = b.bitcast(b.gep(b.inttoptr(args[7], F32.as_pointer()), [ir.Constant(I64, 8 * t)]),
                                     V8F.as_pointer())
                    dm = b.fmul(b.fsub(ir.Constant(F32, -0.0), da_), k.f16(82))
                    b.store(_fma_f64(b, _splat(b, dm, 8), b.sitofp(pairs(t, mins), V8F), b.load(accp, align=4)),
                            accp, align=4)
                if qtype == "Q6_K":             # less 32 (bsums[2l] scales[2l] + bsums[2l+1] scales[2l+1])
                    sumi[t] = b.sub(sumi[t], b.shl(pairs(t, scales), ir.Constant(V8I32, [5] * 8)))
                accp = b.bitcast(b.gep(b.inttoptr(args[7], F32.as_pointer()), [ir.Constant(I64, 8 * t)]),
                                 V8F.as_pointer())
                b.store(_fma_f64(b, _splat(b, b.fmul(da_, d), 8), b.sitofp(sumi[t], V8F), b.load(accp, align=4)), accp,
                        align=4)
                if dmin is None:
                    continue
                dm = b.fmul(b.fsub(ir.Constant(F32, -0.0), da_), dmin)
                q8 = b.mul(mins, b.load(b.bitcast(at(4, I32, 8, t), V8I32.as_pointer()), align=4))  # mins[g] q8s[g]
                accm = b.gep(b.inttoptr(args[8], F32.as_pointer()), [ir.Constant(I64, 4 * t)])
                if qtype == "Q4_K":
                    prod = b.add(_i32s(b, q8, range(0, 8, 2)), _i32s(b, q8, range(1, 8, 2)))
                    vp = b.bitcast(accm, V4F.as_pointer())
                    b.store(_fma_f64(b, _splat(b, dm, 4), b.sitofp(prod, V4F), b.load(vp, align=4)), vp, align=4)
                else:                           # Q5_K: one sum of the 8, in order (integers: exact)
                    total = b.extract_element(q8, ir.Constant(I32, 0))
                    for g in range(1, 8):
                        total = b.add(total, b.extract_element(q8, ir.Constant(I32, g)))
                    b.store(_fma_f64(b, dm, b.sitofp(total, F32), b.load(accm, align=4)), accm, align=4)
        _per_type(b, args[0], KQUANT, emit)
        return context.get_dummy_value()
    return types.void(code, n_tokens, *([types.intp] * 8)), codegen


def _emit_ggml(b, qtype, n_rows, tokens, rowsa, aheada, qaa, qa_stride, daa, saa, d_stride, outa, out_stride,
               n_blocks):
    """ggml's vec_dot of n_rows legacy-quant rows with `tokens` Q8 activation rows (qa int8 [T, B*32], da, sa f32
    [T, B]): per block, lane l = sum of elements 4l..4l+3 (integers: _ggml_block), acc_l = fma(d * da, lane,
    acc_l), the float32 fused multiply-add of ggml's x86 code (numerics.ggml_cpu emulates it in float64, where the
    product is exact and the sum rounds once to float64 before float32: the same float unless that lands on a
    float32 tie, some 2^-29 of sums); summs += m * sa in float32; out = ((a0+a4)+(a2+a6)) + ((a1+a5)+(a3+a7))
    (+ summs)."""
    V8 = ir.VectorType(F32, 8)
    block_bytes = BLOCKS[qtype][1]
    rows, ahead = _pointers(b, rowsa, n_rows), _pointers(b, aheada, n_rows)
    qap = _strided(b, qaa, qa_stride, tokens, I8)
    dap, sap = _strided(b, daa, d_stride, tokens, F32), _strided(b, saa, d_stride, tokens, F32)
    keys = [(r, t) for r in range(n_rows) for t in range(tokens)]
    init = {("acc", r, t): ir.Constant(V8, [0.0] * 8) for r, t in keys}
    init.update({("summs", r, t): ir.Constant(F32, 0.0) for r, t in keys})

    def body(i, st):
        acts = [_ggml_acts(b, qtype, b.gep(qap[t], [b.mul(i, ir.Constant(I64, 32))])) for t in range(tokens)]
        scales = [(b.load(b.gep(dap[t], [i])), b.load(b.gep(sap[t], [i]))) for t in range(tokens)]
        for r in range(n_rows):
            sums, d, m = _ggml_block(b, qtype, _block_at(b, rows[r], ahead[r], i, block_bytes), acts)
            for t, (da, sa) in enumerate(scales):
                lanes = b.sitofp(sums[t], V8)      # exact (< 2^17)
                st["acc", r, t] = _fma(b, _splat(b, b.fmul(d, da), 8), lanes, st["acc", r, t])
                if m is not None:
                    st["summs", r, t] = b.fadd(st["summs", r, t], b.fmul(m, sa))
        return st

    end = _block_loop(b, n_blocks, init, body)
    outp = b.inttoptr(outa, F32.as_pointer())
    for r, t in keys:
        e = [b.extract_element(end["acc", r, t], ir.Constant(I32, j)) for j in range(8)]
        y = b.fadd(b.fadd(b.fadd(e[0], e[4]), b.fadd(e[2], e[6])), b.fadd(b.fadd(e[1], e[5]), b.fadd(e[3], e[7])))
        if qtype in ("Q4_1", "Q5_1"):
            y = b.fadd(y, end["summs", r, t])
        b.store(y, b.gep(outp, [b.add(b.mul(out_stride, ir.Constant(I64, t)), ir.Constant(I64, r))]))


@intrinsic
def ggml_tile(typingctx, code, n_rows, n_tokens, rowsa, aheada, qaa, qa_stride, daa, saa, d_stride, outa,
              out_stride, n_blocks):
    """ggml_tile(code, R, T, rows, ahead, qa, qa_stride, da, sa, d_stride, out, out_stride, n_blocks): _emit_ggml
    for the legacy type TYPE_CODE[...] = code (a switch over the five), R and T constants; qa_stride in bytes,
    d_stride (da's and sa's) in elements."""
    return _tile(code, (n_rows, n_tokens), 10, LEGACY, _emit_ggml)


# -- ggml's float32 dot products as ggml_cpu emulates them (numerics "ggml" attention) ---------------------------
F64 = ir.DoubleType()


def _fma_f64(b, a, x, c):
    """a * x + c for float32 vectors or scalars as ggml_cpu.fma emulates ggml's fused multiply-add: the product exact
    in float64, the sum in float64, rounded to float32 (no contraction: numba's code is not fast-math)."""
    vd = ir.VectorType(F64, a.type.count) if isinstance(a.type, ir.VectorType) else F64
    return b.fptrunc(b.fadd(b.fmul(b.fpext(a, vd), b.fpext(x, vd)), b.fpext(c, vd)), a.type)


def _f32_vector(b, addr, at, lanes):
    """<lanes x float> at float index `at` (an i64 value) of the float32s at address addr."""
    p = b.gep(b.inttoptr(addr, F32.as_pointer()), [at])
    return b.load(b.bitcast(p, ir.VectorType(F32, lanes).as_pointer()), align=4)


def _counted_loop(b, n, step, init, body):
    """for i in range(0, n, step) (n a multiple of step): state = body(i, state) -> the final state."""
    count = b.sdiv(n, ir.Constant(I64, step))
    return _block_loop(b, count, init, lambda j, st: body(b.mul(j, ir.Constant(I64, step)), st))


def _literal_lanes(lanes):
    return lanes.literal_value if isinstance(lanes, types.IntegerLiteral) and lanes.literal_value in (8, 16) else None


@intrinsic
def prefetch(typingctx, addr, n_bytes):
    """prefetch(addr, N): hints to bring the cache lines of N bytes at address addr in (N a constant); no effect on
    any value (kquant_rows: the next row's super-block while this row's is multiplied)."""
    if not isinstance(n_bytes, types.IntegerLiteral):
        return None
    size = n_bytes.literal_value

    def codegen(context, builder, signature, args):
        p = builder.inttoptr(args[0], I8.as_pointer())
        for line in range(0, size, 64):
            _prefetch(builder, builder.gep(p, [ir.Constant(I64, line)]))
        return context.get_dummy_value()
    return types.void(addr, n_bytes), codegen


@intrinsic
def lanes_dot(typingctx, aa, ba, n, lanes):
    """lanes_dot(a, b, n, LANES) -> float32: one accumulator of LANES (8 or 16, a constant) lanes over n floats (a
    multiple of LANES) at addresses a and b, each step acc = fma(a, b, acc) as ggml_cpu emulates it, then the lanes
    summed halves first (ggml_cpu.hsum): tinyBLAS's f32/f16 tile sums, numba_ggml's `_lanes_dot`."""
    w = _literal_lanes(lanes)
    if w is None:
        return None

    def codegen(context, builder, signature, args):
        a, x, n_ = args[:3]
        v = ir.VectorType(F32, w)
        end = _counted_loop(builder, n_, w, {"acc": ir.Constant(v, [0.0] * w)}, lambda i, st: {
            "acc": _fma_f64(builder, _f32_vector(builder, a, i, w), _f32_vector(builder, x, i, w), st["acc"])})
        return _hsum(builder, end["acc"])
    return types.float32(types.intp, types.intp, types.intp, lanes), codegen


def _hadds(b, t):
    """AVX2's sum of 8 lanes by two hadds after adding the halves: (u0 + u1) + (u2 + u3), u = t[:4] + t[4:]."""
    pick = lambda idx: b.shuffle_vector(t, t, ir.Constant(ir.VectorType(I32, len(idx)), idx))    # noqa: E731
    u = b.fadd(pick([0, 1, 2, 3]), pick([4, 5, 6, 7]))
    p = b.fadd(b.shuffle_vector(u, u, ir.Constant(ir.VectorType(I32, 2), [0, 2])),
               b.shuffle_vector(u, u, ir.Constant(ir.VectorType(I32, 2), [1, 3])))
    return b.fadd(b.extract_element(p, ir.Constant(I32, 0)), b.extract_element(p, ir.Constant(I32, 1)))


@intrinsic
def vec_dot_f32(typingctx, aa, ba, n, lanes):
    """vec_dot_f32(a, b, n, LANES) -> float32: ggml_vec_dot_f32 as numba_ggml._vec_dot emulates it on float32s: 4
    accumulators of LANES lanes over steps of 4 LANES, folded (0+2)+(1+3) lane by lane then summed as AVX2's two
    hadds do (_hadds) or AVX-512's reduce_add (halves first) (numba_ggml._fold), the leftover products added in
    order in float32."""
    w = _literal_lanes(lanes)
    if w is None:
        return None

    def codegen(context, builder, signature, args):
        b = builder
        a, x, n_ = args[:3]
        v, step = ir.VectorType(F32, w), 4 * w
        body = b.sub(n_, b.srem(n_, ir.Constant(I64, step)))
        init = {j: ir.Constant(v, [0.0] * w) for j in range(4)}

        def one(i, st):
            return {j: _fma_f64(b, _f32_vector(b, a, b.add(i, ir.Constant(I64, j * w)), w),
                                _f32_vector(b, x, b.add(i, ir.Constant(I64, j * w)), w), st[j]) for j in range(4)}
        end = _counted_loop(b, body, step, init, one)
        t = b.fadd(b.fadd(end[0], end[2]), b.fadd(end[1], end[3]))
        r = _hsum(b, t) if w == 16 else _hadds(b, t)
        pa, px = b.inttoptr(a, F32.as_pointer()), b.inttoptr(x, F32.as_pointer())
        rest = _block_loop(b, b.sub(n_, body), {"r": r}, lambda j, st: {"r": b.fadd(st["r"], b.fmul(
            b.load(b.gep(pa, [b.add(body, j)])), b.load(b.gep(px, [b.add(body, j)]))))})
        return rest["r"]
    return types.float32(types.intp, types.intp, types.intp, lanes), codegen


# -- scalar bit helpers for numba code that reproduces ggml's elementwise arithmetic (numba_ggml) -------------
def _scalar(name, arg, res, emit, doc):
    """An intrinsic of one scalar of numba type `arg` -> `res`, its IR emit(builder, value)."""
    def typer(typingctx, x):
        if x != arg:
            return None

        def codegen(context, builder, signature, args):
            return emit(builder, args[0])
        return res(arg), codegen
    typer.__name__ = typer.__qualname__ = name
    typer.__doc__ = doc
    return intrinsic(typer)


f32_bits = _scalar("f32_bits", types.float32, types.int32, lambda b, v: b.bitcast(v, I32),
                   "A float32's bits as an int32 (NumPy's view(np.int32)).")
f32_from_bits = _scalar("f32_from_bits", types.int32, types.float32, lambda b, v: b.bitcast(v, F32),
                        "An int32's bits as a float32 (NumPy's view(np.float32)).")
f16_bits_to_f32 = _scalar("f16_bits_to_f32", types.uint16, types.float32, lambda b, v: b.fpext(b.bitcast(v, F16), F32),
                          "A float16 held as its 16 bits (a uint16 view of a float16 array) -> its value as float32.")
f32_to_f16_bits = _scalar("f32_to_f16_bits", types.float32, types.uint16,
                          lambda b, v: b.bitcast(b.fptrunc(v, F16), I16),
                          "A float32 rounded to float16 (ties to even, as NumPy's astype(float16)) -> its 16 bits.")
