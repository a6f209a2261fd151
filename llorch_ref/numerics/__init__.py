"""Numerics modes. `exact`: plain float32 math (the default). `ggml`: ggml's CPU arithmetic, step by step."""

NUMERICS = ("exact", "ggml")
KV_DTYPES = ("f32", "f16")          # the K/V cache types (llama.cpp's names)
