"""Sources of tensors, each writing the same dump: llama.cpp through its eval callback and transformers through
forward hooks (engines.py, llamacpp.py), and llorch-ref itself on any backend and numerics (llorch.py)."""
