"""A small pure-PyTorch Llama written for the tests: a subject engine nobody else wrote, with other layouts.

It reads a Hugging Face folder (HF row order for Wq/Wk, so the half-split 'neox' RoPE), keeps per-head
tensors head-major ([H, T, Hd]) and has no K/V cache (greedy re-runs the whole sequence). Its dump
declares those layouts: {"rope_pairs": "neox", "heads": "head_major"}. `bug` plants one mistake, to prove
the suite catches it at the right checkpoint.

Plugin protocol: make_dump(model_path, token_ids) -> Recorder (LLORCH_TORCH_BUG=<bug> plants a bug).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from llorch_ref.dump import Recorder

BUGS = ("rms_eps", "rope_adjacent", "pos_off_by_one", "gqa_tile", "scale")


def load(folder):
    from safetensors.torch import load_file
    folder = Path(folder)
    c = json.loads((folder / "config.json").read_text())
    w = {}
    for f in sorted(folder.glob("*.safetensors")):
        w.update({k: v.float() for k, v in load_file(str(f)).items()})
    return c, w


def forward(c, w, ids, rec=None, bug=None):
    """ids: [T] -> logits [T, V] float32. rec: Recorder (head-major, neox)."""
    add = rec.add if rec is not None else (lambda *a, **k: None)
    t = len(ids)
    h, kv, d = c["num_attention_heads"], c["num_key_value_heads"], c["hidden_size"]
    hd = c.get("head_dim") or d // h
    eps = c["rms_norm_eps"] * (10.0 if bug == "rms_eps" else 1.0)
    scale = (1.0 / hd) if bug == "scale" else hd ** -0.5
    pos = torch.arange(t, dtype=torch.float64) + (1 if bug == "pos_off_by_one" else 0)
    inv = c.get("rope_theta", 10000.0) ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    ang = pos[:, None] * inv[None, :]                                      # [T, Hd/2]
    cos, sin = torch.cos(ang).float(), torch.sin(ang).float()

    def rms(x, g):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * g

    def rope(x):                                                            # x: [heads, T, Hd]
        if bug == "rope_adjacent":
            a, b = x[..., 0::2], x[..., 1::2]
            return torch.stack([a * cos - b * sin, a * sin + b * cos], -1).flatten(-2)
        a, b = x[..., : hd // 2], x[..., hd // 2:]
        return torch.cat([a * cos - b * sin, a * sin + b * cos], -1)

    x = w["model.embed_tokens.weight"][torch.tensor(ids)]                  # [T, D]
    mask = torch.full((t, t), float("-inf")).triu(1)
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        hn = rms(x, w[p + "input_layernorm.weight"])
        add("cp1.attn_norm", hn, layer=i)
        q = (hn @ w[p + "self_attn.q_proj.weight"].T).view(t, h, hd).transpose(0, 1)      # [H, T, Hd]
        k = (hn @ w[p + "self_attn.k_proj.weight"].T).view(t, kv, hd).transpose(0, 1)     # [KV, T, Hd]
        v = (hn @ w[p + "self_attn.v_proj.weight"].T).view(t, kv, hd).transpose(0, 1)
        add("cp2.q_proj", q, layer=i); add("cp2.k_proj", k, layer=i); add("cp2.v", v, layer=i)
        q, k = rope(q), rope(k)
        add("cp1B.q", q, layer=i); add("cp1B.k", k, layer=i)
        add("cp3.k_cache", k, layer=i); add("cp3.v_cache", v, layer=i)
        rep = h // kv
        kr = k.repeat(rep, 1, 1) if bug == "gqa_tile" else k.repeat_interleave(rep, 0)     # [H, T, Hd]
        vr = v.repeat(rep, 1, 1) if bug == "gqa_tile" else v.repeat_interleave(rep, 0)
        kq = q @ kr.transpose(1, 2)                                         # [H, T, T]
        add("cp4.kq", kq, layer=i)
        probs = torch.softmax(kq * scale + mask, dim=-1)
        add("cp4.kq_soft_max", probs, layer=i)
        o = probs @ vr                                                      # [H, T, Hd]
        add("cp5.kqv_out", o, layer=i)
        o = o.transpose(0, 1).reshape(t, h * hd) @ w[p + "self_attn.o_proj.weight"].T
        add("cp5.attn_out", o, layer=i)
        x = x + o
        add("cp5.ffn_inp", x, layer=i)
        hn = rms(x, w[p + "post_attention_layernorm.weight"])
        add("cp1.ffn_norm", hn, layer=i)
        g = hn @ w[p + "mlp.gate_proj.weight"].T
        u = hn @ w[p + "mlp.up_proj.weight"].T
        s = torch.nn.functional.silu(g) * u
        add("cp6.ffn_swiglu", s, layer=i)
        f = s @ w[p + "mlp.down_proj.weight"].T
        add("cp6.ffn_out", f, layer=i)
        x = x + f
        add("cp7.l_out", x, layer=i)
    x = rms(x, w["model.norm.weight"])
    add("cp8.result_norm", x)
    out = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    return x @ out.T


def run(folder, token_ids, bug=None, n_greedy=16) -> Recorder:
    if bug is not None and bug not in BUGS:
        raise ValueError(f"unknown bug {bug!r} (known: {', '.join(BUGS)})")
    c, w = load(folder)
    rec = Recorder("torch-llama (tests)", torch.__version__ + (f" bug={bug}" if bug else ""), model_path=folder,
                   token_ids=token_ids, layouts={"rope_pairs": "neox", "heads": "head_major"})
    with torch.no_grad():
        logits = forward(c, w, list(token_ids), rec, bug)
        rec.add("cp8.logits", logits)
        rec.add("cp9.logits", logits[-1])
        seq, gen = list(token_ids), []
        for _ in range(n_greedy):
            nxt = int(torch.argmax(forward(c, w, seq, None, bug)[-1]))
            gen.append(nxt)
            seq.append(nxt)
        rec.add("cp12.greedy_tokens", torch.tensor(gen))
    return rec


def make_dump(model_path, token_ids):
    """The pytest-plugin protocol. model_path: the reference's model (a GGUF is converted to an HF folder)."""
    from llorch_ref.references.engines import hf_folder_for
    return run(hf_folder_for(model_path), token_ids, bug=os.environ.get("LLORCH_TORCH_BUG") or None)
