"""Everything the CuPy backend needs measured on a GPU, in one run (CI has no GPU; results are committed).

    python tools/gpu_run.py --out DIR [--model PATH] [--skip-7b] [--no-speed]

1. cupy vs numpy, every checkpoint (float32 and float16 weights), on tiny random models and, with --model,
   on the real default model; greedy tokens equal.
2. Speed: prefill (128 tokens) and decode (128 tokens) tokens/s of llorch-ref cupy next to transformers
   (eager, and for float16 its static-cache compiled generation too: the fair anchor; same card, same call) for the default model's shape and a Llama-2-7B shape, random weights,
   float32 and float16; GPU work synchronized before each clock read; medians of 3 after a warm-up.
Writes results.json and results.md into --out.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("CUPY_TF32", "0")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_roofline import free_gpu, median_of, ours, random_engine, theirs  # noqa: E402, F401 (random_engine: gpu_profile)


def checkpoint_tables(model_paths, out):
    import llorch_ref
    from llorch_ref.harness.run import run_backend_diff

    rows = []
    for label, path in model_paths:
        ref = llorch_ref.load(path, backend="numpy")
        for dtype in ("float32", "float16"):
            eng = llorch_ref.load(path, backend="cupy", dtype=dtype)
            r = run_backend_diff(eng, ref, n_greedy=32)
            for s in r.summary():
                rows.append({"model": label, "dtype": dtype, **{k: s[k] for k in (
                    "checkpoint", "name", "rows", "failed", "worst_nmse", "worst_max_abs", "min_cosine",
                    "min_agreement", "equal_prefix", "band", "passed")}})
            print(f"checkpoints {label} cupy {dtype}: first divergence {r.first_divergence}; greedy "
                  f"{r.greedy.get('equal_prefix')}/{r.greedy.get('n')}", flush=True)
            del eng
    return rows


def speed_ours(cfg, dtype, prefill=128, decode=128, graphs=True):
    """llorch-ref cupy on random weights of cfg's shape (gpu_roofline.ours)."""
    return ours(cfg, dtype, prefill=prefill, decode=decode, graphs=graphs)


def speed_transformers(cfg, dtype, prefill=128, decode=128):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tdt = torch.float16 if dtype == "float16" else torch.float32
    torch.backends.cuda.matmul.allow_tf32 = False
    hf = LlamaConfig(vocab_size=cfg.n_vocab, hidden_size=cfg.d_model, intermediate_size=cfg.d_ff,
                     num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
                     num_key_value_heads=cfg.n_kv_heads, rms_norm_eps=cfg.rms_eps, rope_theta=cfg.rope_base,
                     max_position_embeddings=2048, tie_word_embeddings=False, attn_implementation="eager")
    with torch.device("cuda"):
        model = LlamaForCausalLM(hf).to(tdt).eval()
    ids = torch.arange(1, prefill + 1, device="cuda")[None]

    def pf():
        torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.no_grad():
            model(ids)
        torch.cuda.synchronize()
        return prefill / (time.perf_counter() - t)

    def dc():
        torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.no_grad():
            model.generate(ids[:, :8], max_new_tokens=decode, min_new_tokens=decode, do_sample=False,
                           pad_token_id=0)
        torch.cuda.synchronize()
        return decode / (time.perf_counter() - t)
    out = {"prefill_tok_s": median_of(pf), "decode_tok_s": median_of(dc)}
    return out


def _speed_row(r) -> str:
    fast = r.get("transformers_compiled")
    compiled = f"{fast['decode_tok_s']:.1f} | {r['decode_ratio_compiled']:.2f}x" if fast else "- | -"
    return (f"| {r['shape']} | {r['dtype']} | {r['ours']['prefill_tok_s']:.0f} | {r['transformers']['prefill_tok_s']:.0f} | "
            f"{r['ours']['decode_tok_s']:.1f} | {r['ours_eager']['decode_tok_s']:.1f} | "
            f"{r['transformers']['decode_tok_s']:.1f} | {compiled} | {r['decode_ratio']:.2f}x |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default=None)
    ap.add_argument("--skip-7b", action="store_true")
    ap.add_argument("--no-speed", action="store_true", help="checkpoint tables only")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    import cupy
    import numpy

    from llorch_ref.backends import get_backend
    from llorch_ref.config import Config
    from llorch_ref.testing.tiny import write_tiny_model

    be = get_backend("cupy")
    env = {"device": be.device, "cupy": cupy.__version__, "numpy": numpy.__version__,
           "CUPY_TF32": os.environ.get("CUPY_TF32"), "python": sys.version.split()[0]}
    try:
        import torch
        import transformers
        env.update(torch=torch.__version__, transformers=transformers.__version__)
    except ImportError:
        pass
    print(json.dumps(env), flush=True)
    report = {"env": env, "command": "python tools/gpu_run.py " + " ".join(sys.argv[1:])}
    tiny_dir = Path("/tmp/llorch_gpu_tiny")
    tiny_dir.mkdir(exist_ok=True)
    models = [("tiny-gqa-f32", write_tiny_model(tiny_dir / "gqa.gguf", vocab="bpe", n_kv_heads=2)),
              ("tiny-mha-q8_0", write_tiny_model(tiny_dir / "q8.gguf", vocab="bpe", weight_type="Q8_0",
                                                 n_kv_heads=4))]
    if a.model:
        models.append(("SmolLM2-135M-Instruct Q4_1", Path(a.model)))
    report["checkpoints"] = checkpoint_tables(models, out)
    shapes = {"SmolLM2-135M shape": Config(arch="llama", n_vocab=49152, d_model=576, n_layers=30, n_heads=9,
                                           n_kv_heads=3, head_dim=64, d_ff=1536, context_length=2048,
                                           rms_eps=1e-5, rope_base=100000.0, rope_dim=64, rope_style="adjacent",
                                           tied_output=False)}
    if not a.skip_7b:
        shapes["Llama-2-7B shape"] = Config(arch="llama", n_vocab=32000, d_model=4096, n_layers=32, n_heads=32,
                                            n_kv_heads=32, head_dim=128, d_ff=11008, context_length=4096,
                                            rms_eps=1e-5, rope_base=10000.0, rope_dim=128, rope_style="neox",
                                            tied_output=False)
    speed = []
    for label, cfg in ({} if a.no_speed else shapes).items():
        for dtype in ("float32", "float16"):
            o = speed_ours(cfg, dtype)
            free_gpu()
            eager = speed_ours(cfg, dtype, graphs=False)
            t = speed_transformers(cfg, dtype)
            free_gpu()
            row = {"shape": label, "dtype": dtype, "ours": o, "ours_eager": eager, "transformers": t,
                   "decode_ratio": o["decode_tok_s"] / t["decode_tok_s"],
                   "prefill_ratio": o["prefill_tok_s"] / t["prefill_tok_s"]}
            if dtype == "float16":          # transformers' fastest configuration: static cache, compiled generation
                fast = theirs(cfg, prefill=128, decode=128, static=True)
                row.update(transformers_compiled=fast,
                           decode_ratio_compiled=o["decode_tok_s"] / fast["decode_tok_s"])
            speed.append(row)
            print(json.dumps(row), flush=True)
    report["speed"] = speed
    (out / "results.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    md = [f"# GPU results ({env['device']})", "", f"Command: `{report['command']}`", "",
          "Environment: " + ", ".join(f"{k} {v}" for k, v in env.items()), "",
          "## Checkpoints: cupy against the numpy backend", "",
          "| model | dtype | checkpoint | comparisons | failed | worst NMSE | worst max abs | min cosine / agreement | band |",
          "|---|---|---|---|---|---|---|---|---|"]
    for r in report["checkpoints"]:
        sim = r["min_cosine"] if r["min_cosine"] is not None else (
            f"{r['equal_prefix']} tokens equal" if r["equal_prefix"] is not None else f"agreement {r['min_agreement']}")
        md.append(f"| {r['model']} | {r['dtype']} | {r['checkpoint']} {r['name']} | {r['rows']} | {r['failed']} | "
                  f"{r['worst_nmse']} | {r['worst_max_abs']} | {sim} | `{json.dumps(r['band'])}` |")
    md += ["", "## Speed: llorch-ref cupy next to transformers, same card, same call", "",
           "transformers eager, and for float16 also its fastest configuration (static cache, generation compiled by "
           "torch.compile): the anchor a decode ratio should be read against.", "",
           "| shape | dtype | ours prefill tok/s | transformers prefill tok/s | ours decode tok/s (CUDA graph) | "
           "ours decode tok/s (eager) | transformers decode tok/s (eager) | transformers decode tok/s (static, "
           "compiled) | decode ratio vs compiled | vs eager |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    md += [_speed_row(r) for r in speed]
    if any(r["ours"].get("graph_error") for r in speed):
        md.append("")
        md.append("CUDA graph capture failed: " + next(r["ours"]["graph_error"] for r in speed if r["ours"].get("graph_error")))
    (out / "results.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
