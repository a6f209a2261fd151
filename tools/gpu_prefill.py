"""Prompt and decode speed of the cupy backend on GGUF blocks next to llama.cpp's CUDA build, on the same files in
the same run (one card).

    python tools/gpu_prefill.py --out DIR [--types Q4_0,Q8_0,Q4_K,Q6_K] [--shape llama2-7b] [--tokens 512]
                                [--llama-bench PATH] [--work DIR]

For each type, a random-weight GGUF of --shape (tools/make_big_model.py) is loaded with --dtype blocks, and a
prompt of --tokens tokens timed (medians of 3 after a warm-up, the card synchronized around each) three ways:
  split     nobody watches, the default: weights and activations in two float16 parts on tensor cores
  float16   nobody watches, ops.blocks_prompt = "float16": float16 weights, activations and attention
  recorded  a no-op recorder of every tensor: the float32 products of gguf-py's weights (TF32 off)
with the last row's logits of the first two against the recorded ones (NMSE); decode: 128 greedy tokens after an
8-token prompt (CUDA graphs, the fused step). Then, with --llama-bench (waited for up to --wait s: a build may
still be running), `llama-bench -m FILE -ngl 99 -p TOKENS -n 128 -fa 0,1 -r 3 -o jsonl` on each same file.
Writes prefill.json (every row, the card, the command and the commit) into --out.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("CUPY_TF32", "0")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))


def commit() -> str:
    """LLORCH_COMMIT where set (a copy of the tree run elsewhere, whose git HEAD may not be the tree's), else HEAD."""
    if os.environ.get("LLORCH_COMMIT"):
        return os.environ["LLORCH_COMMIT"]
    try:
        return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def timed(fn, n=3):
    """Median of n runs of fn() -> seconds, after one warm-up run."""
    import cupy as cp

    def once():
        cp.cuda.Device().synchronize()
        t = time.perf_counter()
        fn()
        cp.cuda.Device().synchronize()
        return time.perf_counter() - t
    once()
    return statistics.median(once() for _ in range(n))


def ours(path, tokens):
    """The cupy backend on one file: prefill tok/s unwatched and recorded, the two's last-row logits NMSE, decode."""
    import cupy as cp

    import llorch_ref
    from llorch_ref.engine import GenerationResult

    eng = llorch_ref.load(path, backend="cupy", dtype="blocks", n_ctx=tokens + 16)
    ids = [(7 * i + 3) % 30000 + 1 for i in range(tokens)]
    noop = lambda name, layer, arr: None                               # noqa: E731

    def run(prompt, record=None):
        eng.ops.blocks_prompt = prompt
        return eng.forward(ids, eng.new_cache(), rows=[tokens - 1], record=record)
    want = cp.asnumpy(run("split", noop)).astype("float64")
    row = {}
    for prompt in ("split", "float16"):
        got = cp.asnumpy(run(prompt)).astype("float64")
        row[f"prefill_{prompt}_tok_s"] = tokens / timed(lambda: run(prompt))          # noqa: B023
        row[f"{prompt}_vs_recorded_nmse"] = float(((got - want) ** 2).sum() / (want ** 2).sum())
        row[f"{prompt}_same_argmax"] = bool(got.argmax() == want.argmax())
    row["prefill_recorded_tok_s"] = tokens / timed(lambda: run("split", noop))
    eng.ops.blocks_prompt = "split"

    def dc():
        res = GenerationResult()
        for _ in eng.generate_ids(ids[:8], max_tokens=128, ignore_eos=True, result=res):
            pass
        return res
    dc()
    row["decode_tok_s"] = statistics.median(128 / dc().decode_s for _ in range(3))
    row["fused_decode"] = eng.backend.info.get("fused_decode")
    row["blocks_mb"] = eng.backend.info.get("blocks_mb")
    return row


def llama_bench(binary, path, tokens):
    """llama-bench's rows for the file: prefill and decode tok/s, flash attention off and on."""
    env = dict(os.environ, LD_LIBRARY_PATH=str(Path(binary).parent))
    r = subprocess.run([binary, "-m", str(path), "-ngl", "99", "-p", str(tokens), "-n", "128", "-fa", "0,1", "-r", "3",
                        "-o", "jsonl"], capture_output=True, text=True, env=env, timeout=600)
    if r.returncode != 0:
        return {"error": r.stderr[-2000:]}
    rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    out = {}
    for x in rows:
        kind = "prefill" if x.get("n_prompt") else "decode"
        out[f"{kind}_tok_s{'_fa' if x.get('flash_attn') else ''}"] = x.get("avg_ts")
    out["build"] = rows[0].get("build_commit") if rows else None
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--types", default="Q4_0,Q8_0,Q4_K,Q6_K")
    ap.add_argument("--shape", default="llama2-7b")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--llama-bench", default=None, help="llama.cpp's llama-bench (CUDA build)")
    ap.add_argument("--wait", type=float, default=600, help="seconds to wait for --llama-bench to exist")
    ap.add_argument("--work", default="/tmp/gpu_prefill", help="where the model files are written (then removed)")
    a = ap.parse_args()
    import make_big_model
    from gpu_roofline import card, free_gpu

    from llorch_ref.backends import cpu_model

    out, work = Path(a.out), Path(a.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    doc = {"made_by": {"command": "python tools/gpu_prefill.py " + " ".join(sys.argv[1:]), "commit": commit(),
                       "machine": f"{card()['name']}, host CPU {cpu_model()}"},
           "card": card(), "shape": a.shape, "tokens": a.tokens, "rows": []}
    paths = []
    for qtype in a.types.split(","):
        path = work / f"{a.shape}.{qtype}.gguf"
        make_big_model.write(path, shape=a.shape, qtype=qtype)
        row = {"qtype": qtype, "file_gb": round(path.stat().st_size / 1e9, 2), "ours": ours(path, a.tokens)}
        free_gpu()                                   # our engine's memory back before the next one
        doc["rows"].append(row)
        paths.append(path)
        print(json.dumps(row), flush=True)
        (out / "prefill.json").write_text(json.dumps(doc, indent=1) + "\n")
    if a.llama_bench:
        t0 = time.time()
        while not Path(a.llama_bench).exists() and time.time() - t0 < a.wait:
            time.sleep(5)
        doc["llama_bench_waited_s"] = round(time.time() - t0, 1)
        for row, path in zip(doc["rows"], paths):
            row["llamacpp"] = llama_bench(a.llama_bench, path, a.tokens) if Path(a.llama_bench).exists() else {
                "error": f"no {a.llama_bench} after {a.wait} s"}
            print(json.dumps(row), flush=True)
            (out / "prefill.json").write_text(json.dumps(doc, indent=1) + "\n")
    for path in paths:
        path.unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main())
