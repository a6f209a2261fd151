"""The canonical weight layout: NumPy order, float32, [out_features, in_features] like nn.Linear.

GPT-2's Conv1D matrices, stored [in, out], are held transposed like every other matrix here.
RMSNorm weights are the multipliers the norm applies (y = x / rms(x) * w). Gemma's Hugging Face layout
stores w - 1 (its norm computes x / rms * (1 + w)); GGUF files store the multiplier. The HF adapter adds 1."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class LayerWeights:
    attn_norm: np.ndarray   # [D]
    wq: np.ndarray          # [H*Hd, D]   rows laid out for Config.rope_style
    wk: np.ndarray          # [KV*Hd, D]  rows laid out for Config.rope_style
    wv: np.ndarray          # [KV*Hd, D]
    wo: np.ndarray          # [D, H*Hd]
    ffn_norm: np.ndarray    # [D]
    w_gate: np.ndarray      # [F, D]      None where the FFN has no gate (Config.ffn_gated False: GPT-2)
    w_up: np.ndarray        # [F, D]
    w_down: np.ndarray      # [D, F]
    bq: np.ndarray | None = None   # [H*Hd]  biases of the projections (Config.qkv_bias; rows as wq's)
    bk: np.ndarray | None = None   # [KV*Hd]
    bv: np.ndarray | None = None   # [KV*Hd]
    q_norm: np.ndarray | None = None          # [Hd]  QK-norm weights (Config.qk_norm; Gemma 3)
    k_norm: np.ndarray | None = None          # [Hd]
    post_attn_norm: np.ndarray | None = None  # [D]   norms on the attention / FFN outputs (Config.post_norms)
    post_ffn_norm: np.ndarray | None = None   # [D]
    attn_norm_b: np.ndarray | None = None     # [D]   LayerNorm biases (Config.norm "layer": GPT-2)
    ffn_norm_b: np.ndarray | None = None      # [D]
    bo: np.ndarray | None = None              # [D]   biases of the output projection and the FFN (Config.linear_bias)
    b_up: np.ndarray | None = None            # [F]
    b_down: np.ndarray | None = None          # [D]


@dataclass
class Weights:
    tok_embd: np.ndarray    # [V, D]
    layers: list[LayerWeights]
    out_norm: np.ndarray    # [D]
    output: np.ndarray      # [V, D] (the same array as tok_embd when the output is tied)
    pos_embd: np.ndarray | None = None     # [P, D] learned absolute positions (Config.pos_embd "learned": GPT-2)
    out_norm_b: np.ndarray | None = None   # [D]    the final LayerNorm's bias (Config.norm "layer")

    lazy = False

    def info(self) -> dict:
        """Eager weights: storage dtype and size (as LazyWeights.info reports them)."""
        arrays = [self.tok_embd, self.out_norm, self.pos_embd, self.out_norm_b]
        arrays += ([] if self.output is self.tok_embd else [self.output])
        arrays += [a for lw in self.layers for a in vars(lw).values()]
        mb = round(sum(getattr(a, "nbytes", 0) for a in arrays) / 2**20, 1)
        return {"lazy": False, "storage": str(getattr(self.layers[0].wq, "dtype", "blocks")), "dequantized_mb": mb,
                "budget_mb": None, "used_mb": mb}

    def map(self, fn) -> "Weights":
        """Apply fn to every array (e.g. upload to a GPU), keeping tied arrays tied."""
        tied = self.output is self.tok_embd
        tok = fn(self.tok_embd)
        keep = lambda a: fn(a) if isinstance(a, np.ndarray) else a      # matrix objects (ggml numerics) stay
        return Weights(
            tok_embd=tok,
            layers=[LayerWeights(**{k: keep(v) for k, v in vars(lw).items()}) for lw in self.layers],
            out_norm=fn(self.out_norm),
            output=tok if tied else keep(self.output),
            pos_embd=keep(self.pos_embd),
            out_norm_b=keep(self.out_norm_b),
        )
