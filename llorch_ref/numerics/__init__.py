"""Numerics modes. `exact`: plain float32 math (the default). `ggml`: ggml's CPU arithmetic, step by step.
`ort`: ONNX Runtime's CPU arithmetic for int4/int8 MatMulNBits weights (int8 activations; ONNX folders)."""

NUMERICS = ("exact", "ggml", "ort")
