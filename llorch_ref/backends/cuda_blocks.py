"""GGUF blocks on the GPU: a QTensor uploaded as the file holds it, multiplied by CUDA kernels.

ROWS (shared with cuda_fused's decode step) reads a row of a matrix in any format the card holds (float16,
float32, Q4_0, Q4_1, Q8_0, Q4_K, Q6_K) eight weights (an oct) at a time, and rows_dot takes the dot products of
a few rows with x by a warp (or several). Integer codes become floats by the exact 2^23 trick (the code's mask and
the magic number in one LOP3, then one subtraction), not the slower int-to-float conversion. Then:

  gemv          one token (decode): each format's layout (GEMV_LAYOUT: octs a lane in flight, rows a warp);
                the scales applied once per oct, d * sum(q x) (+ m * sum(x)): the dequantized weights'
                products summed in another order of float32 roundings (Q4_K's scales decoded once for four
                octs and its blocks fetched a pass ahead: rows_dot's F::SHARES)
  dequant       several tokens (prefill): the matrix dequantized into a float32 scratch bit for bit as gguf-py
                does (oct: products and sums rounded explicitly, __fmul_rn / __fadd_rn, so that the compiler
                fuses nothing into an FMA), then cuBLAS (TF32 off), the same product the float32 path computes;
                for prompts nobody watches, those weights split into two float16 parts (dequant_split) and
                multiplied on tensor cores with split activations (cuda_half.split_gemm: float32's band), or
                rounded to float16 alone (dequant16: float16's band)

Q6_K matrices are repacked at load (GpuBlocks.repacked, REPACKED: the same codes and scales, each 210-byte
super-block padded to 224 so that it starts 16-byte aligned), so that their one-token products fetch an oct's codes
with two 8-byte loads instead of eight 2-byte ones; the kernels of a matrix are its format's (GpuBlocks.fmt), the
same products to the bit as the file's layout (settings' cuda_repack off: the file's layout everywhere). Q4_0
repacked likewise (8 scales, then 8 x 16 bytes of nibbles a super-block: one load an oct) timed no faster, its
products bound by their instructions and the loads' latency rather than the L1 pipe
(results/gpu/h200/layouts-repacked.json), and stays in the file's layout.

So a recorded blocks product differs from the numpy oracle's (float32 weights from gguf-py, BLAS) by
rounding order only.
The one-token products are bound by their instructions (about 5-9 a weight: mask, convert, multiply-add, the scales,
loads) and their loads' latency, not by DRAM: ncu in results/gpu/h200/ncu-gemv-q4_k-q4_0.txt, and
ncu-gemv-repacked.txt (the repacked Q4_0 halved the L1 traffic, not the time).
"""
from __future__ import annotations

from .cuda_half import half_gemm, split_gemm
from .cuda_source import cuda_source
from .settings import settings

TYPES = {"Q4_0": (0, 18, 32), "Q4_1": (1, 20, 32), "Q8_0": (2, 34, 32), "Q4_K": (3, 144, 256),
         "Q6_K": (4, 210, 256)}                # type -> (kernel code, bytes per block, weights per block)

# the format a type is repacked into at load (rows.cu's Q6_KR) and its bytes a super-block of 256 weights
REPACKED = {"Q6_K": ("q6_kr", 224)}
FORMATS = [q.lower() for q in TYPES] + [f for f, _ in REPACKED.values()]

ROWS = cuda_source("rows.cu")

# How each block type's one-token product (GpuBlocks.matmul, the op-by-op step) is laid out: octs a lane in flight a
# row (U), rows a warp group (R), warps a row (W), as tools/gpu_roofline.py profile chose them over whole op-by-op
# steps (one row a warp for Q4_K and Q6_K; two for Q4_0, Q4_1 and Q8_0).
GEMV_LAYOUT = {"q4_0": (2, 2, 1), "q4_1": (4, 2, 1), "q8_0": (2, 2, 1), "q4_k": (4, 1, 1), "q6_k": (4, 1, 1),
               "q6_kr": (4, 1, 1)}
STRUCTS = {"f16": "F16", "f32": "F32", "q4_0": "Q4_0", "q4_1": "Q4_1", "q8_0": "Q8_0", "q4_k": "Q4_K", "q6_k": "Q6_K",
           "q6_kr": "Q6_KR"}


def planar_places(n, xp):
    """-> [n] the place of each index of a vector of n floats (n % 8 == 0) in rows_dot's planar layout: the host's
    twin of the device function planar() in ROWS (laid[planar_places(n)] = natural lays a vector out)."""
    e = xp.arange(n)
    return xp.where(e & 4, n // 2, 0) + (e >> 3) * 4 + (e & 3)


def rows_per_block(layout):
    """Rows a block of 128 threads covers with layout (U, R, W)."""
    u, r, w = layout
    return r * (4 // w)


def gemv_source(layout=None, name="gemv_{f}", planar=False):
    """A one-token product kernel for each format of layout ({format: (U, R, W)}, GEMV_LAYOUT by default), named
    name.format(f=format, u=U, r=R, w=W), with the arguments (W, x, y, n, k, rb); launched as
    ceil(n / rows_per_block(layout)) blocks of 128 threads. planar: x in rows_dot's planar layout."""
    p = "true" if planar else "false"
    return "".join(f'extern "C" __global__ void {name.format(f=f, u=u, r=r, w=w)}(const u8* W, const float* x, '
                   f'float* y, int n, int k, long rb) {{ gemv_rows<{STRUCTS[f]}, {u}, {r}, {w}, false, false, {p}>(W, '
                   f'x, nullptr, y, n, k, rb, 0.f); }}\n'
                   for f, (u, r, w) in (layout or GEMV_LAYOUT).items())


SRC = ROWS + gemv_source() + cuda_source("dequant.cu")

_MODULE = {}


def compile_options():
    """nvcc options for sources built on ROWS: with settings' cuda_q4k_shared off, Q4_K's scales are decoded once an
    oct and no blocks fetched ahead (the same products to the bit)."""
    shared = settings().cuda_q4k_shared
    return ("-std=c++17", f"-DLLORCH_Q4K_SHARED={int(shared)}")


def kernels(cp):
    """{"gemv_q4_0": RawKernel, "dequant_q4_0": ..., ...}, compiled once per process (again where
    compile_options() changed)."""
    opts = compile_options()
    if _MODULE.get("options") != opts:
        _MODULE.clear()
        _MODULE["options"] = opts
        mod = cp.RawModule(code=SRC, options=opts)
        for fmt in FORMATS:
            for kind in ("gemv", "dequant", "dequant16", "dequant_split"):
                _MODULE[f"{kind}_{fmt}"] = mod.get_function(f"{kind}_{fmt}")
    return _MODULE


class GpuBlocks:
    """A quantized matrix [N, K] on the GPU (uint8 [N, row bytes]) in format fmt: the file's layout (its type's
    name, the default) or the one repacked() makes; matmul(x) by that format's kernels. From a QTensor (upload,
    then repacked), or from blocks already on the device (random models)."""

    ndim = 2

    def __init__(self, qtype, shape, blocks, cp, fmt=None):
        if qtype not in TYPES:
            raise ValueError(f"no GPU kernel for {qtype} (have {', '.join(TYPES)})")
        self.qtype, self.shape, self.blocks, self.cp = qtype, tuple(shape), blocks, cp
        self.fmt = fmt or qtype.lower()
        self.units = self.shape[1] // 32
        self.dtype = cp.dtype(cp.float32)              # what a product returns
        self._k = kernels(cp)

    def __getitem__(self, rows):
        """Rows lo:hi (a slice), a view of the same device memory."""
        lo, hi, _ = rows.indices(self.shape[0])
        return GpuBlocks(self.qtype, (hi - lo, self.shape[1]), self.blocks[lo:hi], self.cp, self.fmt)

    @classmethod
    def from_qtensor(cls, qt, cp):
        return cls(qt.qtype, qt.shape, cp.asarray(qt.blocks), cp).repacked()

    def repacked(self):
        """-> the matrix in its type's repacked format (REPACKED) where it has one, it is in the file's layout and
        settings' cuda_repack is on; else itself."""
        fmt, size = REPACKED.get(self.qtype, (None, 0))
        if fmt is None or self.fmt != self.qtype.lower() or not settings().cuda_repack:
            return self
        cp, n, sb = self.cp, self.shape[0], self.shape[1] // 256
        raw = cp.zeros((n, sb, size), dtype=cp.uint8)
        raw[..., :210] = self.blocks.reshape(n, sb, 210)
        return GpuBlocks(self.qtype, self.shape, raw.reshape(n, sb * size), cp, fmt)

    @property
    def nbytes(self) -> int:
        return int(self.blocks.nbytes)

    def dequantize(self, dtype="float32"):
        """-> the weights on the device: float32 [N, K] as gguf-py dequantizes them; "float16": those floats rounded
        to float16; "split": [N, 2K] float16, [hi | lo] with w = hi + lo * 2^-11 (cuda_half.split_gemm's form)."""
        cp, n = self.cp, self.shape[0]
        kind, shape, out_type = {"float32": ("dequant", self.shape, cp.float32),
                                 "float16": ("dequant16", self.shape, cp.float16),
                                 "split": ("dequant_split", (n, 2 * self.shape[1]), cp.float16)}[dtype]
        out = cp.empty(shape, dtype=out_type)
        total = n * self.units * 4
        self._k[f"{kind}_{self.fmt}"](((total + 255) // 256,), (256,),
                                                (self.blocks, out, cp.int32(n), cp.int32(self.units),
                                                 cp.int64(self.blocks.shape[1])))
        return out

    def matmul(self, x, prompt="float32"):
        """x: [T, K] -> [T, N] float32: the GEMV kernel for one token; for more, the matrix dequantized into a
        scratch and multiplied by cuBLAS as `prompt` says: "float32" (TF32 off), "split" (split_gemm: float16 parts
        on tensor cores, float32's band), "float16" (float16 weights and activations on tensor cores, float32
        accumulation: float16's band)."""
        cp = self.cp
        n = self.shape[0]
        if x.shape[0] != 1 and prompt == "split":
            return split_gemm(cp, x, self.dequantize("split"))
        if x.shape[0] != 1 and prompt == "float16":
            return half_gemm(cp, x, self.dequantize("float16"))
        x = cp.ascontiguousarray(x, dtype=cp.float32)
        if x.shape[0] != 1:
            return x @ self.dequantize().T
        y = cp.empty((1, n), dtype=cp.float32)
        fmt = self.fmt
        per = rows_per_block(GEMV_LAYOUT[fmt])
        self._k[f"gemv_{fmt}"](((n + per - 1) // per,), (128,), (self.blocks, x, y, cp.int32(n), cp.int32(self.shape[1]),
                                                              cp.int64(self.blocks.shape[1])))
        return y
