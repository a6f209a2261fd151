"""Numerics modes. `exact`: plain float32 math (the default). `ggml`: ggml's CPU arithmetic, step by step."""

NUMERICS = ("exact", "ggml")
