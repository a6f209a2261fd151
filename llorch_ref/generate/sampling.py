"""Token selection. Greedy is argmax; probabilities are computed in float64 (checkpoint 11 says so)."""
from __future__ import annotations

import numpy as np


def greedy(logits) -> int:
    """logits: [V] -> the token with the highest logit (lowest id on exact ties, like np.argmax)."""
    return int(np.argmax(logits))


def softmax(logits, axis=-1):
    """logits: [..., V] float32 -> probabilities [..., V] float64 (max-subtracted, normalized in float64)."""
    x = np.asarray(logits, dtype=np.float64)
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)
