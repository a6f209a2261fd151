"""A decode step for llama weights in five kernels a layer (the cupy backend's generation path): float16 weights,
or --dtype blocks (GGUF blocks, float32 where the card keeps a matrix unquantized).

The op-by-op step runs the model's operations one by one, each a checkpoint the harness can record: about
fifteen kernels a layer, most of them tiny. Generation records nothing, so here the operations are fused at
their boundaries, the way numba's FusedDecoder does on the CPU:

  norm_qkv_<fmt>  RMSNorm folded into the Q/K/V product: y = r * W (x * g), r = 1 / sqrt(mean(x^2) + eps),
                  the sum of squares computed by every warp from the x it reads anyway (one launch for Q/K/V in
                  one allocation, three where their types differ)
  rope_attend     RoPE on Q and K, K and V written into the cache at the device-side position, attention
                  over the positions written so far (nothing past them read): a block per head, past 256
                  positions a block per head and chunk of 128, the chunks' partial softmax sums combined by each
                  head's last block
  gemv_res_<fmt>  the output projection added to the residual stream in place (x += W a)
  norm_glu_<fmt>  RMSNorm, gate and up rows i and F+i together, silu(g) * u written
  gemv_res_<fmt>  the down projection added to the residual stream

and the final norm with the output matrix (norm_logits_<fmt>). <fmt> is each matrix's format (cuda_blocks.ROWS
reads them all; LAYOUT below sets each product's rows a warp and loads in flight). Each kernel is launched with
programmatic dependent launch (Launcher; settings' cuda_pdl): it starts while the previous one drains and waits
for the previous kernel's results before reading anything. The arithmetic
differs from the op-by-op step's by order and rounding only (r applied after the dot product, sums of squares in
float32): tests/test_backends.py checks the logits against the op-by-op step's (float16 and blocks) and the greedy
tokens equal. settings' cuda_fused turns it off. On blocks, whose products are bound by their instructions, the
norm folded into a product serves two or four rows a warp (LAYOUT).
"""
from __future__ import annotations

import ctypes

import numpy as np

from .cuda_blocks import GEMV_LAYOUT, ROWS, STRUCTS, GpuBlocks, compile_options, planar_places, rows_per_block
from .cuda_source import cuda_source
from .settings import settings

FUSED = cuda_source("fused.cu")


def fused_source():
    """The step's four products for each weight format, as LAYOUT says (U octs a lane, R rows, W warps a row):
    norm_qkv_<fmt> (Q/K/V with the layer's first norm folded in), norm_logits_<fmt> (the output matrix with the
    final norm), norm_glu_<fmt> (gate and up with the second norm), gemv_res_<fmt> (the output and down projections
    added to the residual stream in place, x += W a); W as bytes, rb bytes a row. The formats of LAYOUT_PLANAR
    again as <role>_<fmt>_p, reading and writing the step's vectors in the planar layout."""
    out = []
    for planar, table in ((False, LAYOUT), (True, LAYOUT_PLANAR)):
        P, sfx = ("true", "_p") if planar else ("false", "")
        for f, roles in table.items():
            (u, r, w), (u2, r2, w2), (u3, w3), (u4, r4, w4) = (roles[k] for k in ROLES)
            F = STRUCTS[f]
            out.append(
                f'extern "C" __global__ void norm_qkv_{f}{sfx}(const u8* W, const float* x, const float* g, float* y, '
                f'int n, int k, long rb, float eps) {{ gemv_rows<{F}, {u}, {r}, {w}, true, false, {P}>(W, x, g, y, n, k, '
                f'rb, eps); }}\n'
                f'extern "C" __global__ void norm_logits_{f}{sfx}(const u8* W, const float* x, const float* g, float* y, '
                f'int n, int k, long rb, float eps) {{ gemv_rows<{F}, {u2}, {r2}, {w2}, true, false, {P}>(W, x, g, y, n, '
                f'k, rb, eps); }}\n'
                f'extern "C" __global__ void norm_glu_{f}{sfx}(const u8* W, const float* x, const float* g, float* hid, '
                f'int f, int k, long rb, float eps) {{ norm_glu<{F}, {u3}, {w3}, {P}>(W, x, g, hid, f, k, rb, eps); }}\n'
                f'extern "C" __global__ void gemv_res_{f}{sfx}(const u8* W, const float* a, float* y, int n, int k, '
                f'long rb) {{ gemv_rows<{F}, {u4}, {r4}, {w4}, false, true, {P}, {P}>(W, a, nullptr, y, n, k, rb, 0.f); }}\n')
    return "".join(out)


# per weight format: its reader (cuda_blocks.ROWS) and each product's layout, (U octs a lane in flight a row, R rows,
# W warps a row; norm_glu: U, W for its two rows), as tools/gpu_roofline.py layouts chose them. On blocks the
# products with the norm folded in take more rows a warp than the plain ones (the norm's x g and sum of squares
# shared by more rows); Q4_K's norm_qkv takes four rows a warp, its scales decoded once for four octs.
ROLES = ("norm_qkv", "norm_logits", "norm_glu", "gemv_res")
LAYOUT = {"f16": {"norm_qkv": (2, 4, 1), "norm_logits": (4, 2, 1), "norm_glu": (4, 1), "gemv_res": (4, 1, 1)},
          "f32": {"norm_qkv": (2, 2, 1), "norm_logits": (2, 2, 1), "norm_glu": (2, 1), "gemv_res": (2, 1, 1)},
          "q4_0": {"norm_qkv": (2, 4, 1), "norm_logits": (2, 4, 1), "norm_glu": (4, 1), "gemv_res": (2, 2, 1)},
          "q4_1": {"norm_qkv": (4, 2, 1), "norm_logits": (4, 2, 1), "norm_glu": (4, 1), "gemv_res": (4, 2, 1)},
          "q8_0": {"norm_qkv": (2, 4, 1), "norm_logits": (2, 4, 1), "norm_glu": (2, 1), "gemv_res": (2, 2, 1)},
          "q4_k": {"norm_qkv": (4, 4, 1), "norm_logits": (4, 2, 1), "norm_glu": (2, 1), "gemv_res": (4, 1, 1)},
          "q6_k": {"norm_qkv": (4, 4, 1), "norm_logits": (4, 2, 1), "norm_glu": (4, 1), "gemv_res": (4, 2, 1)}}
# Q6_K repacked (cuda_blocks.REPACKED): its residual products take eight octs a lane in flight (layouts-repacked.json)
LAYOUT["q6_kr"] = {**LAYOUT["q6_k"], "gemv_res": (8, 1, 1)}
# The formats whose steps keep the step's vectors in the planar layout (rows_dot's PLANAR: a warp's x loads take
# half the L1 wavefronts; the same sums to the bit), with their layouts so: a step is planar where every matrix it
# reads is of one of these formats (the default model's Q4_1 and Q8_0 included); settings' cuda_planar off: every
# step natural. The choice and its timings: `tools/gpu_roofline.py layouts`, results/gpu/h200/layouts-planar.json.
LAYOUT_PLANAR = {"q4_0": {**LAYOUT["q4_0"], "gemv_res": (8, 1, 1)},
                 "q4_1": {**LAYOUT["q4_1"], "gemv_res": (8, 1, 1)},
                 "q8_0": {**LAYOUT["q8_0"], "norm_qkv": (4, 2, 1), "gemv_res": (8, 1, 1)}}
assert set(LAYOUT) >= set(GEMV_LAYOUT)


def blocks_of(fmt, role, n, planar=False):
    """Blocks of 128 threads a product of (LAYOUT_PLANAR if planar else LAYOUT)[fmt][role] over n rows (norm_glu: n
    gate/up pairs) launches."""
    lay = (LAYOUT_PLANAR if planar else LAYOUT)[fmt][role]
    per = rows_per_block((lay[0], 1, lay[1]) if role == "norm_glu" else lay)
    return ((n + per - 1) // per,)


ATTEND = cuda_source("attend.cu")
_MOD = {}
ATTEND_THREADS = 1024
ATTEND_ONE, ATTEND_CHUNK = 256, 128  # rope_attend: one block a head up to 256 positions, else chunks of 128 (ATTEND)


def source():
    """The step's CUDA source, its products laid out as LAYOUT says now (tools/gpu_roofline.py layouts swaps them)."""
    return (ROWS + FUSED + fused_source() + f"#define ATTEND_ONE {ATTEND_ONE}\n#define ATTEND_CHUNK {ATTEND_CHUNK}\n"
            + ATTEND)


def kernels(cp):
    """The step's kernels, compiled once per process (a cleared _MOD compiles them again from source())."""
    opts = compile_options()
    if _MOD.get("options") != opts:
        _MOD.clear()
        _MOD["options"] = opts
        mod = cp.RawModule(code=source(), options=opts)
        names = [f"{k}_{f}" for f in LAYOUT for k in ROLES] + [f"{k}_{f}_p" for f in LAYOUT_PLANAR for k in ROLES]
        for name in names + ["rope_attend_f32", "rope_attend_f16", "embed_f32", "embed_f16"]:
            _MOD[name] = mod.get_function(name)
    return _MOD


def weight_format(m, cp):
    """A matrix on the card -> (its format's kernel suffix, the array the kernel reads, bytes a row), or None."""
    if isinstance(m, GpuBlocks):
        fmt = m.fmt
        return (fmt, m.blocks, int(m.blocks.shape[1])) if fmt in LAYOUT else None
    if not isinstance(m, cp.ndarray) or m.ndim != 2 or not m.flags.c_contiguous:
        return None
    fmt = {cp.dtype(cp.float16): "f16", cp.dtype(cp.float32): "f32"}.get(m.dtype)
    return None if fmt is None else (fmt, m, int(m.shape[1] * m.itemsize))


class _Attr(ctypes.Structure):               # CUlaunchAttribute: id, padding, a 64-byte value union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int * 16)]


class _Config(ctypes.Structure):             # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("smem", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_Attr)), ("n_attrs", ctypes.c_uint)]


class Launcher:
    """launch(kernel, grid, block, args, shared_mem): cuLaunchKernelEx with the programmatic-stream-serialization
    attribute (through the driver library, which CuPy's RawKernel does not expose), so that consecutive kernels of
    a step overlap their launch and ramp with the previous one's tail (a captured graph keeps the edges as
    programmatic). Falls back to CuPy's launch where the driver lacks cuLaunchKernelEx."""

    PROGRAMMATIC_STREAM_SERIALIZATION = 6

    def __init__(self, cp, enabled=True):
        self.cp, self.fn = cp, None
        if enabled:
            try:
                self.fn = ctypes.CDLL("libcuda.so.1").cuLaunchKernelEx
                self.fn.restype = ctypes.c_int
            except (OSError, AttributeError):
                self.fn = None
        self.attr = _Attr(id=self.PROGRAMMATIC_STREAM_SERIALIZATION)
        self.attr.value[0] = 1

    def __call__(self, kernel, grid, block, args, shared_mem=0):
        if self.fn is None:
            return kernel(grid, block, args, shared_mem=shared_mem)
        cp = self.cp
        vals = [ctypes.c_void_p(a.data.ptr) if isinstance(a, cp.ndarray) else ctypes.c_int(int(a)) if a.dtype == np.int32
                else ctypes.c_longlong(int(a)) if a.dtype == np.int64 else ctypes.c_float(float(a)) for a in args]
        params = (ctypes.c_void_p * len(vals))(*[ctypes.addressof(v) for v in vals])
        g, b = tuple(grid) + (1,) * (3 - len(grid)), tuple(block) + (1,) * (3 - len(block))
        cfg = _Config((ctypes.c_uint * 3)(*g), (ctypes.c_uint * 3)(*b), shared_mem,
                      ctypes.c_void_p(cp.cuda.get_current_stream().ptr), ctypes.pointer(self.attr), 1)
        err = self.fn(ctypes.byref(cfg), ctypes.c_void_p(kernel.kernel.ptr), params, None)
        if err:
            raise RuntimeError(f"cuLaunchKernelEx failed with CUDA error {err}")


class FusedStep:
    """step(tok) -> logits [1, V]: one decode step over the device cache at its device-side position (the caller
    advances it), from preallocated buffers (capturable as a CUDA graph). plan() gives None where the model or
    its weights need anything this step does not do; the op-by-op step then serves."""

    def __init__(self, engine, cache, groups, out, planar=False):
        cp, cfg = engine.xp, engine.config
        self.cp, self.cfg, self.cache, self.w, self.out = cp, cfg, cache, engine.weights, out
        pdl = settings().cuda_pdl and int(cp.cuda.Device().compute_capability) >= 90
        self.K, self.launch = kernels(cp), Launcher(cp, enabled=pdl)        # the attribute needs sm_90 (Hopper)
        self.planar = planar                                           # the step's vectors in the planar layout
        self.groups = [(*g[:4], self.laid(g[4]), self.laid(g[5])) for g in groups]     # the norms' weights laid out
        self.out_norm = self.laid(engine.weights.out_norm)                              # as the step's vectors
        engine.backend.info["cuda_pdl"] = self.launch.fn is not None
        engine.backend.info["fused_planar"] = planar
        d, h, kv, hd = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.x = cp.empty(d, cp.float32)
        self.y = cp.empty((h + 2 * kv) * hd, cp.float32)
        self.att = cp.empty(h * hd, cp.float32)
        self.hid = cp.empty(cfg.d_ff, cp.float32)
        self.logits = cp.empty((1, cfg.n_vocab), cp.float32)
        self.kv16 = cache.k.dtype == cp.float16
        self.smem = 4 * (3 * hd + ATTEND_ONE + ATTEND_THREADS // 32 * hd)
        self.chunks = -(-cache.n_ctx // ATTEND_CHUNK)       # rope_attend's grid (h, chunks): those past pos exit
        self.part = cp.empty((h, self.chunks, hd + 2), cp.float32)      # each chunk's max, sum and P.V
        self.count = cp.zeros(h, cp.int32)                              # chunks done, per head (reset by the last)

    def laid(self, v):
        """A vector of floats as the step keeps its vectors: in the planar layout where the step is planar."""
        if not self.planar:
            return v
        out = self.cp.empty_like(v)
        out[planar_places(v.size, self.cp)] = v
        return out

    def product(self, role, fmt, n):
        """-> (the kernel of `role` for a matrix of format fmt, its grid over n rows), in the step's layout."""
        return self.K[f"{role}_{fmt}{'_p' if self.planar else ''}"], blocks_of(fmt, role, n, self.planar)

    @staticmethod
    def plan(engine, cache, layers):
        """layers: per layer (Q/K/V stacked in one allocation, or the three where they are not, wo, gate/up stacked or
        None, w_down, attn_norm, ffn_norm) -> a FusedStep, or None. Float16 weights, or --dtype blocks (each matrix its GGUF
        blocks of a type the kernels read, or float32 where the GPU keeps one)."""
        cfg, w, cp = engine.config, engine.weights, engine.xp
        if not settings().cuda_fused or getattr(engine.backend, "dtype", "") not in (
                "float16", "blocks") \
                or cfg.qkv_bias or cfg.qk_norm or cfg.post_norms or cfg.ffn_act != "silu" or cfg.sliding_window \
                or cfg.rope_base_local is not None or cfg.rope_style not in ("adjacent", "neox") \
                or cfg.head_dim > ATTEND_THREADS or cfg.d_model % 8 or cfg.d_ff % 8 or cfg.n_heads * cfg.head_dim % 8 \
                or cache.k.dtype not in (cp.float32, cp.float16) or cfg.head_dim % 4 \
                or 4 * (3 * cfg.head_dim + ATTEND_ONE + ATTEND_THREADS // 32 * cfg.head_dim) > 48 * 1024:
            return None
        groups = []
        for qkv, *mats in layers:
            parts = [weight_format(m, cp) for m in (qkv if isinstance(qkv, (list, tuple)) else [qkv])]
            fmts = [None if m is None else weight_format(m, cp) for m in mats[:3]]
            if None in fmts or None in parts:
                return None
            groups.append((parts, *fmts, *mats[3:]))
        out = weight_format(w.output, cp)
        if out is None or w.tok_embd.dtype not in (cp.float32, cp.float16):
            return None
        fmts = {out[0]} | {p[0] for g in groups for p in g[0]} | {m[0] for g in groups for m in g[1:4]}
        planar = settings().cuda_planar and fmts <= set(LAYOUT_PLANAR)
        return FusedStep(engine, cache, groups, out, planar=planar)

    def __call__(self, tok):
        cp, cfg, c, K, go = self.cp, self.cfg, self.cache, self.K, self.launch
        i32, i64, f32 = cp.int32, cp.int64, cp.float32
        d, h, kv, hd, f = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff
        eps, half = f32(cfg.rms_eps), cfg.rope_dim // 2
        emb = self.w.tok_embd
        pl = i32(self.planar)
        go(K["embed_f16" if emb.dtype == cp.float16 else "embed_f32"],
           ((d + 255) // 256,), (256,), (emb, tok, self.x, i32(d), f32(cfg.embed_scale or 1.0), pl))
        cos, sin = c.tables()
        attend = "rope_attend_f16" if self.kv16 else "rope_attend_f32"
        neox = i32(cfg.rope_style == "neox")
        for i, (qkv, (fo, wo, ro), (fg, gu, rg), (fd, wd, rd), an, fn) in enumerate(self.groups):
            at = 0
            for fq, wq, rq in qkv:       # Q/K/V in one matrix, or three where their types differ
                n = wq.shape[0]
                go(*self.product("norm_qkv", fq, n), (128,), (wq, self.x, an, self.y[at:], i32(n), i32(d), i64(rq), eps))
                at += n
            go(K[attend], (h, self.chunks), (ATTEND_THREADS,),
               (self.y, cos, sin, c.pos_dev, c.k[i], c.v[i], self.att, self.part, self.count, i32(h), i32(kv), i32(hd),
                i32(half), neox, f32(cfg.scale), pl), shared_mem=self.smem)
            go(*self.product("gemv_res", fo, d), (128,), (wo, self.att, self.x, i32(d), i32(h * hd), i64(ro)))
            go(*self.product("norm_glu", fg, f), (128,), (gu, self.x, fn, self.hid, i32(f), i32(d), i64(rg), eps))
            go(*self.product("gemv_res", fd, d), (128,), (wd, self.hid, self.x, i32(d), i32(f), i64(rd)))
        v, (fo, wout, ro) = cfg.n_vocab, self.out
        go(*self.product("norm_logits", fo, v), (128,), (wout, self.x, self.out_norm, self.logits, i32(v), i32(d),
                                                          i64(ro), eps))
        return self.logits
