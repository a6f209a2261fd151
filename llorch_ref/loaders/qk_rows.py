"""Q/K row orders and the permutations between them, beside the loaders that read them.

GGUF files of adjacent-pair (llama) architectures hold Wq/Wk rows as llama.cpp's converter permuted them:
RoPE pairs (2i, 2i+1). Hugging Face checkpoints hold them half-split: pairs (i, i + Hd/2). Config.rope_style
records which order a loaded model holds; these two functions move between them.
"""
from __future__ import annotations

import numpy as np


def permute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Hugging Face's half-split rows -> llama.cpp's adjacent pairs (what its converter does)."""
    rows, d = w.shape
    hd = rows // n_heads
    return np.ascontiguousarray(w.reshape(n_heads, 2, hd // 2, d).swapaxes(1, 2).reshape(rows, d))


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """[n_heads*Hd, D] rows in llama.cpp's adjacent-pair layout -> Hugging Face's half-split layout.

    The inverse of convert_hf_to_gguf.py's permute: within each head, row 2i (first of pair i) goes to
    row i and row 2i+1 goes to row i + Hd/2."""
    rows, d = w.shape
    hd = rows // n_heads
    return np.ascontiguousarray(w.reshape(n_heads, hd // 2, 2, d).swapaxes(1, 2).reshape(rows, d))
