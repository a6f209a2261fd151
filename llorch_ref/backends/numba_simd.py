"""Row dot products that read GGUF blocks where they lie: explicit 16-lane vector code through LLVM IR.

numba vectorizes a loop over one block's 16 or 32 weights only with a horizontal sum per block or with
runtime alias checks (results/cpu/2026-11-27-cpu-speed.md), so the row-major file order needed a layout
pass before. These intrinsics build the loop over a row's blocks in LLVM IR with vector types: each block's
codes are loaded as <16 x i8>, widened, turned into floats and multiplied by x's 16 matching floats, and
16 lane accumulators run along the row; one fixed-order tree sum at the row's end. No fast-math: LLVM
keeps every multiply and add as written (no reassociation, no fused multiply-add), so a row's result is
the same whatever the thread count, and differs from the NumPy oracle by summation order only.

Per type, `_segments` turns one block (or super-block) into segments: a float32 scale, an optional min
term, and 16-lane code vectors with the x offsets they multiply. w = scale * code (+ min per group of 32,
applied as min * sum(x_group), the sums computed once per product). Every scale and scale*sub-scale is
exact in float32 (a float16 times an integer of at most 8 bits), as gguf-py's dequantization has it.

`dot_tile` is the intrinsic numba code calls: R rows by T tokens at once (R, T and the type constants), each
row's blocks decoded once for its T tokens and x's floats loaded once for the R rows.
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

L = 16
F32, F16 = ir.FloatType(), ir.HalfType()
I8, I16, I32, I64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
VF, VI32, VI8 = ir.VectorType(F32, L), ir.VectorType(I32, L), ir.VectorType(I8, L)

# ggml type -> (weights per block, bytes per block); each a type _segments decodes
BLOCKS = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24), "Q8_0": (32, 34),
          "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210)}
GROUP = 32                                    # the min terms' x groups (Q4_1, Q5_1, Q4_K, Q5_K): sums of 32


def _vi(v):
    return ir.Constant(VI32, [v] * L) if isinstance(v, int) else ir.Constant(VI32, list(v))


class _Block:
    """Reads of one block at i8* p."""

    def __init__(self, b, p):
        self.b, self.p = b, p

    def at(self, off, ty):
        return self.b.bitcast(self.b.gep(self.p, [ir.Constant(I64, off)]), ty.as_pointer())

    def f16(self, off):
        return self.b.fpext(self.b.load(self.at(off, F16), align=1), F32)

    def u8(self, off):
        return self.b.zext(self.b.load(self.at(off, I8), align=1), I32)

    def i8(self, off):
        return self.b.sext(self.b.load(self.at(off, I8), align=1), I32)

    def u32(self, off):
        return self.b.load(self.at(off, I32), align=1)

    def bytes16(self, off, signed=False):
        v = self.b.load(self.at(off, VI8), align=1)
        return self.b.sext(v, VI32) if signed else self.b.zext(v, VI32)

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


def _k4_scales_mins(k):
    """get_scale_min_k4 for the 8 groups at once, from the 12 scale bytes at offset 4: (scales, mins) <8 x i32>.
    Groups 0-3: q[j] & 63, q[j+4] & 63; groups 4-7: (q[j+4] & 15) | (q[j-4] >> 6) << 4, (q[j+4] >> 4) |
    (q[j] >> 6) << 4."""
    b = k.b
    q = k.bytes16(4)                                 # bytes 4..19: the 12 scale bytes and 4 code bytes after
    v8 = lambda c: ir.Constant(ir.VectorType(I32, 8), [c] * 8)                        # noqa: E731
    first = ir.Constant(ir.VectorType(ir.IntType(1), 8), [1] * 4 + [0] * 4)
    p, m = _lanes(b, q, (0, 1, 2, 3, 8, 9, 10, 11)), _lanes(b, q, (4, 5, 6, 7, 8, 9, 10, 11))
    top = lambda idx: b.shl(b.lshr(_lanes(b, q, idx), v8(6)), v8(4))                 # noqa: E731
    sc = b.select(first, b.and_(p, v8(63)), b.or_(b.and_(p, v8(15)), top((0, 1, 2, 3, 0, 1, 2, 3))))
    mn = b.select(first, b.and_(m, v8(63)), b.or_(b.lshr(m, v8(4)), top((4, 5, 6, 7, 4, 5, 6, 7))))
    return sc, mn


def _scaled(b, d, ints):
    """d (a float16's value) times each integer of a vector, in float32: exact (at most 11 x 8 bits)."""
    n = ints.type.count
    return b.fmul(_splat(b, d, n), b.sitofp(ints, ir.VectorType(F32, n)))


def _segments(qtype, k):
    """One block at k -> (segments, mins): segments [(scale <16 x float>, [(codes <16 x float>, x offset)])],
    w = scale * code; mins None or (m, G): w += m per group of 32, m a float (G = 1) or <G x float>."""
    b = k.b
    if qtype in ("Q4_0", "Q4_1"):
        q = k.bytes16(2 if qtype == "Q4_0" else 4)
        lo, hi = _nibbles(k, q, 0), _nibbles(k, q, 4)
        if qtype == "Q4_0":
            lo, hi = b.sub(lo, _vi(8)), b.sub(hi, _vi(8))
        parts = [(k.fl(lo), 0), (k.fl(hi), 16)]
        return [(_splat(b, k.f16(0)), parts)], None if qtype == "Q4_0" else (k.f16(2), 1)
    if qtype in ("Q5_0", "Q5_1"):
        h_at, q_at = (2, 6) if qtype == "Q5_0" else (4, 8)
        qh, q = k.u32(h_at), k.bytes16(q_at)
        lo = b.or_(_nibbles(k, q, 0), k.bits16(qh, 0))
        hi = b.or_(_nibbles(k, q, 4), k.bits16(qh, 16))
        if qtype == "Q5_0":
            lo, hi = b.sub(lo, _vi(16)), b.sub(hi, _vi(16))
        parts = [(k.fl(lo), 0), (k.fl(hi), 16)]
        return [(_splat(b, k.f16(0)), parts)], None if qtype == "Q5_0" else (k.f16(2), 1)
    if qtype == "Q8_0":
        return [(_splat(b, k.f16(0)), [(k.fl(k.bytes16(2, True)), 0), (k.fl(k.bytes16(18, True)), 16)])], None
    if qtype in ("Q4_K", "Q5_K"):
        sc, mn = _k4_scales_mins(k)
        scales = _scaled(b, k.f16(0), sc)
        mins = b.fsub(ir.Constant(ir.VectorType(F32, 8), [0.0] * 8), _scaled(b, k.f16(2), mn))
        q_at, out = (16 if qtype == "Q4_K" else 48), []
        for j in range(8):
            base, shift = q_at + 32 * (j // 2), 4 * (j % 2)
            lo, hi = _nibbles(k, k.bytes16(base), shift), _nibbles(k, k.bytes16(base + 16), shift)
            if qtype == "Q5_K":                          # qh[l] bit j: the fifth bit of element l of group j
                lo = b.or_(lo, b.shl(b.and_(b.lshr(k.bytes16(16), _vi(j)), _vi(1)), _vi(4)))
                hi = b.or_(hi, b.shl(b.and_(b.lshr(k.bytes16(32), _vi(j)), _vi(1)), _vi(4)))
            out.append((_lanes(b, scales, [j] * L), [(k.fl(lo), 32 * j), (k.fl(hi), 32 * j + 16)]))
        return out, (mins, 8)
    if qtype == "Q6_K":
        scales, out = _scaled(b, k.f16(208), k.bytes16(192, True)), []
        for n in range(2):
            for which in range(4):
                for h in range(2):
                    ql = _nibbles(k, k.bytes16(64 * n + 32 * (which % 2) + 16 * h), 4 * (which // 2))
                    qh = b.shl(b.and_(b.lshr(k.bytes16(128 + 32 * n + 16 * h), _vi(2 * which)), _vi(3)), _vi(4))
                    code = b.sub(b.or_(ql, qh), _vi(32))
                    out.append((_lanes(b, scales, [8 * n + h + 2 * which] * L), [(k.fl(code), 128 * n + 32 * which + 16 * h)]))
        return out, None
    raise ValueError(f"no in-place kernel for {qtype}")


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


def _emit_tile(b, qtype, n_rows, tokens, rowsa, aheada, xa, x_stride, xsa, xs_stride, outa, out_stride, n_blocks):
    """The loop over the blocks of n_rows rows (their addresses: int64s at rowsa) for `tokens` tokens at once;
    stores out[t * out_stride + r]. As it goes, it prefetches the same blocks of the n_rows rows at aheada (the
    rows a thread takes next: DRAM's latency hidden where the hardware's prefetchers stop at page ends). Each
    (row, token) has its own accumulators (two for the super-block types, groups alternating, so that the adds
    of one block do not wait on each other), every one updated by the same operations in the same order
    whatever the tile: a product's value does not depend on its tile."""
    block_len, block_bytes = BLOCKS[qtype]
    n_acc, n_mins = (2 if block_len == 256 else 1), {"Q4_K": 8, "Q5_K": 8}.get(qtype, 1)    # min terms' width
    CT = F32 if n_mins == 1 else ir.VectorType(F32, n_mins)
    rows, ahead = _pointers(b, rowsa, n_rows), _pointers(b, aheada, n_rows)
    xp, xsp = _strided(b, xa, x_stride, tokens, F32), _strided(b, xsa, xs_stride, tokens, F32)
    keys = [(r, t) for r in range(n_rows) for t in range(tokens)]
    init = {("acc", r, t, a): ir.Constant(VF, [0.0] * L) for r, t in keys for a in range(n_acc)}
    init.update({("corr", r, t): ir.Constant(CT, 0.0 if n_mins == 1 else [0.0] * n_mins) for r, t in keys})

    def body(i, st):
        x0, g0 = b.mul(i, ir.Constant(I64, block_len)), b.mul(i, ir.Constant(I64, block_len // GROUP))
        xv, xs = {}, {}                                 # x's 16 floats at an offset, group sums: loaded once

        def x_at(t, off):
            if (t, off) not in xv:
                ptr = b.gep(xp[t], [b.add(x0, ir.Constant(I64, off))])
                xv[t, off] = b.load(b.bitcast(ptr, VF.as_pointer()), align=4)
            return xv[t, off]

        def xs_at(t):
            if t not in xs:
                ptr = b.gep(xsp[t], [g0])
                xs[t] = b.load(ptr) if n_mins == 1 else b.load(b.bitcast(ptr, CT.as_pointer()), align=4)
            return xs[t]
        for r in range(n_rows):
            segments, mins = _segments(qtype, _block_at(b, rows[r], ahead[r], i, block_bytes))
            for n, (sv, parts) in enumerate(segments):
                for t in range(tokens):
                    s = None
                    for codes, off in parts:
                        p = b.fmul(codes, x_at(t, off))
                        s = p if s is None else b.fadd(s, p)
                    key = ("acc", r, t, n % n_acc)
                    st[key] = b.fadd(st[key], b.fmul(sv, s))
            for t in range(tokens) if mins is not None else ():
                st["corr", r, t] = b.fadd(st["corr", r, t], b.fmul(mins[0], xs_at(t)))
        return st

    end = _block_loop(b, n_blocks, init, body)
    outp = b.inttoptr(outa, F32.as_pointer())
    for r, t in keys:
        v = end["acc", r, t, 0]
        for a in range(1, n_acc):
            v = b.fadd(v, end["acc", r, t, a])
        c = end["corr", r, t] if n_mins == 1 else _hsum(b, end["corr", r, t])
        at = b.add(b.mul(out_stride, ir.Constant(I64, t)), ir.Constant(I64, r))
        b.store(b.fadd(_hsum(b, v), c), b.gep(outp, [at]))


NAMES = tuple(BLOCKS)
TYPE_CODE = {name: i for i, name in enumerate(NAMES)}


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


def _tile(code, n_rows, n_tokens, n_addr, names, emit):
    """A tile intrinsic's typing: R and T literal integers, then n_addr integer arguments (addresses, strides,
    counts) -> (signature, codegen): a switch on the runtime type code over `names`, each emit(builder, name, R, T,
    *the n_addr values)."""
    if not all(isinstance(a, types.IntegerLiteral) for a in (n_rows, n_tokens)):
        return None
    r, t = n_rows.literal_value, n_tokens.literal_value

    def codegen(context, builder, signature, args):
        _per_type(builder, args[0], names, lambda name: emit(builder, name, r, t, *args[3:]))
        return context.get_dummy_value()
    return types.void(code, n_rows, n_tokens, *([types.intp] * n_addr)), codegen


@intrinsic
def dot_tile(typingctx, code, n_rows, n_tokens, rowsa, aheada, xa, x_stride, xsa, xs_stride, outa, out_stride,
             n_blocks):
    """dot_tile(code, R, T, rows, ahead, x, x_stride, xs, xs_stride, out, out_stride, n_blocks), code = TYPE_CODE[qtype]
    (a switch over every type's loop), R and T constants: out[t * out_stride + r] = row
    r's dot product with x[t * x_stride:] for r < R, t < T (addresses as integers, strides in elements; rows:
    the address of R int64 row addresses; ahead: R more, the rows to prefetch; xs: the sums of x's groups of 32,
    read for the types with a min)."""
    return _tile(code, n_rows, n_tokens, 9, NAMES, _emit_tile)


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


def _lane_sums(b, p_lo, p_hi):
    """Products of elements 0-15 and 16-31 -> <8 x i32>: lane l the sum of elements 4l..4l+3 (exact)."""
    s = None
    for j in range(4):
        v = b.shuffle_vector(p_lo, p_hi, ir.Constant(ir.VectorType(I32, 8), [4 * lane + j for lane in range(8)]))
        s = v if s is None else b.add(s, v)
    return s


def _emit_ggml(b, qtype, n_rows, tokens, rowsa, aheada, qaa, qa_stride, daa, saa, d_stride, outa, out_stride,
               n_blocks):
    """ggml's vec_dot of n_rows legacy-quant rows with `tokens` Q8 activation rows (qa int8 [T, B*32], da, sa f32
    [T, B]): per block, lane l = sum of elements 4l..4l+3 (integers), acc_l = fma(d * da, lane, acc_l) with the
    fused multiply-add computed in float64 and rounded once to float32 (as numerics.ggml_cpu emulates it);
    summs += m * sa in float32; out = ((a0+a4)+(a2+a6)) + ((a1+a5)+(a3+a7)) (+ summs)."""
    V8, D8, VI8_16 = ir.VectorType(F32, 8), ir.VectorType(ir.DoubleType(), 8), ir.VectorType(I8, L)
    block_bytes = BLOCKS[qtype][1]
    rows, ahead = _pointers(b, rowsa, n_rows), _pointers(b, aheada, n_rows)
    qap = _strided(b, qaa, qa_stride, tokens, I8)
    dap, sap = _strided(b, daa, d_stride, tokens, F32), _strided(b, saa, d_stride, tokens, F32)
    keys = [(r, t) for r in range(n_rows) for t in range(tokens)]
    init = {("acc", r, t): ir.Constant(V8, [0.0] * 8) for r, t in keys}
    init.update({("summs", r, t): ir.Constant(F32, 0.0) for r, t in keys})

    def body(i, st):
        acts = []
        for t in range(tokens):
            qa = b.gep(qap[t], [b.mul(i, ir.Constant(I64, 32))])
            lo = b.sext(b.load(b.bitcast(qa, VI8_16.as_pointer()), align=1), VI32)
            hi = b.sext(b.load(b.bitcast(b.gep(qa, [ir.Constant(I64, 16)]), VI8_16.as_pointer()), align=1), VI32)
            acts.append((lo, hi, b.load(b.gep(dap[t], [i])), b.load(b.gep(sap[t], [i]))))
        for r in range(n_rows):
            lo, hi, d, m = _legacy_codes(qtype, _block_at(b, rows[r], ahead[r], i, block_bytes))
            for t, (alo, ahi, da, sa) in enumerate(acts):
                lanes = b.sitofp(_lane_sums(b, b.mul(lo, alo), b.mul(hi, ahi)), D8)
                dd = b.fpext(_splat(b, b.fmul(d, da), 8), D8)
                st["acc", r, t] = b.fptrunc(b.fadd(b.fmul(dd, lanes), b.fpext(st["acc", r, t], D8)), V8)
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
    return _tile(code, n_rows, n_tokens, 10, LEGACY, _emit_ggml)


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
