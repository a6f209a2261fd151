"""llorch-ref: a pure-NumPy reference implementation of Llama-family inference, and a checkpoint harness."""
from __future__ import annotations

__version__ = "0.1.0"


def load(path=None, backend=None, n_ctx=None, numerics="exact", kv_dtype="f32", dtype="float32", threads=None):
    """Load a GGUF file or a Hugging Face model folder (default: SmolLM2-135M-Instruct Q4_1, fetched and cached) -> Engine.

    backend: "numpy" (default, or $LLORCH_BACKEND), "numba" or "cupy"; dtype: weight storage on the
    backend ("float16" for cupy only); numerics: "exact" (float32 math) or "ggml" (llama.cpp's CPU
    arithmetic, numpy backend); kv_dtype: "f32" or "f16" (the K/V cache type; llama.cpp's default is f16)."""
    from pathlib import Path

    from .engine import Engine
    from .errors import ParameterError
    from .loaders.default_model import default_model_path
    from .loaders.gguf_file import load_gguf
    from .tokenizer import from_gguf_metadata

    path = Path(default_model_path() if path is None else path)
    if path.is_dir():                       # a Hugging Face folder: same Config + Weights, exact numerics
        from .loaders.hf_folder import load_hf_folder

        if numerics != "exact":
            raise ParameterError(f"numerics={numerics!r} needs GGUF blocks; a Hugging Face folder runs 'exact'")
        m = load_hf_folder(path)
        tok, raw_blocks = m.tokenizer, None
    else:
        m = load_gguf(path, numerics=numerics)
        tok, raw_blocks = from_gguf_metadata(m.metadata, source=str(m.path)), m.raw_blocks
    return Engine(m.config, m.weights, tok, path=m.path, metadata=m.metadata, tensor_types=m.tensor_types,
                  backend=backend, n_ctx=n_ctx, numerics=numerics, kv_dtype=kv_dtype, dtype=dtype, threads=threads,
                  raw_blocks=raw_blocks)
