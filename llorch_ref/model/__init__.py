"""The Llama forward pass as small functions over an array module `xp` (numpy, cupy, ...)."""
