"""The one canonical model configuration. Loaders fill it; the model reads it."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from .errors import UnsupportedModelError

FFN_ACTS = ("silu", "gelu_tanh")
NORMS = ("rms", "layer")            # rms: RMSNorm (Llama); layer: LayerNorm with a bias (GPT-2)
POS_EMBDS = ("rope", "learned")     # rope: rotary Q/K; learned: a position table added to the embeddings (GPT-2)
ROPE_STYLES = ("adjacent", "neox")  # adjacent: pairs (2i, 2i+1) (GGUF llama); neox: (i, i + n/2) (HF)


@dataclass(frozen=True)
class Config:
    arch: str                 # "llama"
    n_vocab: int              # V
    d_model: int              # D
    n_layers: int             # L
    n_heads: int              # H
    n_kv_heads: int           # KV (H % KV == 0; KV == H is plain multi-head attention)
    head_dim: int             # Hd
    d_ff: int                 # F
    context_length: int       # trained context (n_ctx_train)
    rms_eps: float            # RMSNorm epsilon
    rope_base: float          # RoPE frequency base (theta)
    rope_dim: int             # number of rotated dims per head (<= Hd)
    rope_style: str           # "adjacent" | "neox": how rotated pairs are laid out in Wq/Wk rows
    tied_output: bool         # logits use the token embedding matrix
    attention_scale: float | None = None  # None: 1/sqrt(Hd)
    rope_freq_scale: float = 1.0          # linear RoPE scaling: angles times this (1 / scaling factor)
    rope_freq_factors: tuple | None = None  # [R/2] per-pair divisors of the angle (llama3, YaRN; GGUF rope_freqs;
                                            # LongRoPE's short factors)
    rope_attn_factor: float = 1.0         # cos and sin times this (YaRN's mscale, LongRoPE's attention factor)
    rope_orig_ctx: int = 0                # LongRoPE, dynamic NTK: the original context a sequence is measured against
    rope_freq_factors_long: tuple | None = None  # LongRoPE: [R/2] factors once a sequence is longer than rope_orig_ctx
    rope_ntk_factor: float = 0.0          # dynamic NTK: the base grows past rope_orig_ctx by this factor (0: off)
    rope_yarn_ramp: tuple | None = None   # YaRN: [R/2] extrapolation weights; angle t fs (1 - r) + t r (fs: 1/factor)
    qkv_bias: bool = False                # Q, K, V projections add a bias (Qwen2)
    # Gemma 3 switches (defaults: plain Llama)
    embed_scale: float | None = None      # token embeddings multiplied by this (Gemma: sqrt(D), in float32)
    qk_norm: bool = False                 # RMSNorm over Hd on each Q and K head, before RoPE (weights q_norm, k_norm)
    post_norms: bool = False              # RMSNorm on the attention and FFN outputs before each residual add
    ffn_act: str = "silu"                 # gated FFN activation: "silu" (SwiGLU) | "gelu_tanh" (GeGLU)
    sliding_window: int = 0               # local layers see the last `sliding_window` positions (0: none)
    local_layers: tuple | None = None     # [L] bool: which layers are local (sliding-window) layers
    rope_base_local: float | None = None  # RoPE base of the local layers (unscaled); None: rope_base
    # GPT-2 switches (defaults: plain Llama); rms_eps is then the LayerNorm epsilon
    norm: str = "rms"                     # "rms" | "layer": LayerNorm (x - mean) / std * w + b, weights *_norm_b
    pos_embd: str = "rope"                # "rope" | "learned": embeddings + pos_embd[position], no RoPE
    ffn_gated: bool = True                # False: down(act(up(x) + b_up)) + b_down, no gate (GPT-2's MLP)
    linear_bias: bool = False             # output projection and FFN matrices add a bias (bo, b_up, b_down)
    extra: dict = field(default_factory=dict, compare=False)  # informational metadata only

    def __post_init__(self):
        problems = []
        for name in ("n_vocab", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "d_ff",
                     "context_length", "rope_dim"):
            if int(getattr(self, name)) <= 0:
                problems.append(f"{name}={getattr(self, name)} must be positive")
        if self.n_kv_heads > 0 and self.n_heads % self.n_kv_heads:
            problems.append(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
        if self.rope_dim > self.head_dim or self.rope_dim % 2:
            problems.append(f"rope_dim={self.rope_dim} must be even and <= head_dim={self.head_dim}")
        if self.rope_style not in ROPE_STYLES:
            problems.append(f"rope_style={self.rope_style!r} is not one of {ROPE_STYLES}")
        if not (self.rms_eps > 0):
            problems.append(f"rms_eps={self.rms_eps} must be > 0")
        if not (self.rope_base > 0):
            problems.append(f"rope_base={self.rope_base} must be > 0")
        if not (self.rope_freq_scale > 0):
            problems.append(f"rope_freq_scale={self.rope_freq_scale} must be > 0")
        if self.rope_freq_factors is not None and (len(self.rope_freq_factors) != self.rope_dim // 2
                                                   or not all(f > 0 for f in self.rope_freq_factors)):
            problems.append(f"rope_freq_factors must be {self.rope_dim // 2} positive numbers")
        problems += self._rope_scaling_problems()
        if self.ffn_act not in FFN_ACTS:
            problems.append(f"ffn_act={self.ffn_act!r} is not one of {FFN_ACTS}")
        if self.norm not in NORMS:
            problems.append(f"norm={self.norm!r} is not one of {NORMS}")
        if self.pos_embd not in POS_EMBDS:
            problems.append(f"pos_embd={self.pos_embd!r} is not one of {POS_EMBDS}")
        if not self.ffn_gated and self.ffn_act != "gelu_tanh":
            problems.append(f"an ungated FFN computes GELU (tanh), not ffn_act={self.ffn_act!r}")
        if self.local_layers is not None and len(self.local_layers) != self.n_layers:
            problems.append(f"local_layers has {len(self.local_layers)} entries for {self.n_layers} layers")
        if self.local_layers is not None and any(self.local_layers) and not self.sliding_window > 0:
            problems.append("local layers need sliding_window > 0")
        if problems:
            raise UnsupportedModelError("invalid model configuration: " + "; ".join(problems))

    @property
    def n_rep(self) -> int:
        """Query heads per KV head."""
        return self.n_heads // self.n_kv_heads

    @property
    def scale(self) -> float:
        return self.attention_scale if self.attention_scale is not None else self.head_dim ** -0.5

    @property
    def uses_rope(self) -> bool:
        """Whether Q and K are rotated (False: learned absolute positions, GPT-2): checkpoint 1B applies."""
        return self.pos_embd == "rope"

    def _rope_scaling_problems(self) -> list:
        out = []
        if not (self.rope_attn_factor > 0):
            out.append(f"rope_attn_factor={self.rope_attn_factor} must be > 0")
        long = self.rope_freq_factors_long
        if long is not None and (len(long) != self.rope_dim // 2 or not all(f > 0 for f in long)):
            out.append(f"rope_freq_factors_long must be {self.rope_dim // 2} positive numbers")
        if long is not None and self.rope_freq_factors is None:
            out.append("rope_freq_factors_long needs the short factors in rope_freq_factors")
        ramp = self.rope_yarn_ramp
        if ramp is not None and (len(ramp) != self.rope_dim // 2 or not all(0 <= r <= 1 for r in ramp)):
            out.append(f"rope_yarn_ramp must be {self.rope_dim // 2} numbers in [0, 1]")
        if not (self.rope_ntk_factor == 0 or self.rope_ntk_factor >= 1):
            out.append(f"rope_ntk_factor={self.rope_ntk_factor} must be 0 (off) or >= 1")
        if (long is not None or self.rope_ntk_factor) and self.rope_orig_ctx <= 0:
            out.append("LongRoPE and dynamic NTK need rope_orig_ctx > 0")
        return out

    @property
    def rope_by_length(self) -> bool:
        """Whether the RoPE angles of a step depend on the sequence's length (LongRoPE, dynamic NTK)."""
        return self.rope_freq_factors_long is not None or bool(self.rope_ntk_factor)

    def is_local(self, layer: int) -> bool:
        """Whether this layer attends through the sliding window (Gemma 3's local layers)."""
        return bool(self.local_layers and self.local_layers[layer])

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("extra")
        return d
