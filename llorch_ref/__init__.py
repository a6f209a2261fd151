"""llorch-ref: a pure-NumPy reference implementation of Llama-family inference, and a checkpoint harness."""
from __future__ import annotations

__version__ = "0.1.0"


def load(path=None, backend=None, n_ctx=None, numerics="exact", kv_dtype="f32", dtype="float32", threads=None):
    """Load a GGUF file or a Hugging Face model folder (default: SmolLM2-135M-Instruct Q4_1, fetched and cached) -> Engine.

    backend: "numpy" (default, or $LLORCH_BACKEND), "numba" or "cupy"; dtype: weight storage on the
    backend ("float16" for cupy only); numerics: "exact" (float32 math) or "ggml" (llama.cpp's CPU
    arithmetic, numpy backend); kv_dtype: "f32" or "f16" (the K/V cache type; llama.cpp's default is f16)."""
    from .engine import Engine
    from .loaders.default_model import default_model_path
    from .loaders.gguf_file import load_gguf
    from .tokenizer import from_gguf_metadata

    path = default_model_path() if path is None else path
    from pathlib import Path

    if Path(path).is_dir():
        from .errors import ParameterError
        from .loaders.hf_folder import load_hf_folder

        if numerics != "exact":
            raise ParameterError(f"numerics={numerics!r} needs GGUF blocks; a Hugging Face folder runs 'exact'")
        h = load_hf_folder(path)
        return Engine(h.config, h.weights, h.tokenizer, path=h.path, metadata=h.metadata,
                      tensor_types=h.tensor_types, backend=backend, n_ctx=n_ctx, numerics=numerics,
                      kv_dtype=kv_dtype, dtype=dtype, threads=threads)
    m = load_gguf(path, numerics=numerics)
    tok = from_gguf_metadata(m.metadata, source=str(m.path))
    return Engine(m.config, m.weights, tok, path=m.path, metadata=m.metadata, tensor_types=m.tensor_types,
                  backend=backend, n_ctx=n_ctx, numerics=numerics, kv_dtype=kv_dtype, dtype=dtype, threads=threads,
                  raw_blocks=m.raw_blocks)
