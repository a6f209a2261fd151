"""`llorch-ref bench`: load time, prefill and decode speed, peak memory, for each engine on one file.

Each engine runs in its own process (so peak resident memory is its own), with the same thread count:
llorch-ref backends (numpy, numba, cupy), llama.cpp (llama-cpp-python, low-level API), and transformers
on the CPU when asked. Prefill: one forward over a PREFILL-token prompt (logits of the last row).
Decode: DECODE greedy tokens after an 8-token prompt, EOS ignored, timed from the end of the prompt's
forward (every engine: the prompt's prefill is not in the decode figure). Medians of REPEATS runs after one
warm-up; GPU work is synchronized before each clock read. Output: a JSON file and a Markdown table with
ratios to llama.cpp.
"""
from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import time

import numpy as np

from llorch_ref.backends import cpu_flags, cpu_model
from llorch_ref.engine import GenerationResult
from llorch_ref.loaders.gguf_file import open_reader, read_metadata
from llorch_ref.references.llamacpp import LlamaCpp
from llorch_ref.tokenizer import from_gguf_metadata

PROMPT = ("The history of the world is long and full of surprises. Rivers change their course, cities rise "
          "and fall, and people keep telling stories about all of it. ") * 12


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _speeds(one_prefill, one_decode, repeats) -> dict:
    """Medians of `repeats` runs of each (after one warm-up run: compilation, caches, allocator), with every run
    kept: the run-to-run spread is part of the figure."""
    out = {}
    for name, fn in (("prefill", one_prefill), ("decode", one_decode)):
        fn()
        runs = [fn() for _ in range(repeats)]
        out[f"{name}_tok_s"], out[f"{name}_runs"] = statistics.median(runs), [round(r, 3) for r in runs]
    return out


def _paths():
    """The numba backend's count of matrix products by path (an empty one without numba)."""
    try:
        from llorch_ref.backends.numba_backend import PATHS
    except ImportError:
        from collections import Counter
        return Counter()
    return PATHS


def measure_llorch(path, backend, prefill, decode, repeats, threads, dtype="float32", numerics="exact",
                   weights="auto"):
    import llorch_ref

    cache_mb = os.environ.get("LLORCH_BENCH_WEIGHT_CACHE_MB")
    t0 = time.perf_counter()
    eng = llorch_ref.load(path, backend=backend, threads=threads, dtype=dtype, numerics=numerics, weights=weights,
                          weight_cache_mb=float(cache_mb) if cache_mb and weights != "eager" else None)
    eng.backend.synchronize()
    load_s = time.perf_counter() - t0
    ids = eng.tokenizer.encode(PROMPT)[:prefill] if eng.tokenizer else list(range(1, prefill + 1))
    if len(ids) < prefill:
        raise SystemExit(f"prompt too short: {len(ids)} tokens")

    def one_prefill():
        t = time.perf_counter()
        eng.forward(ids, eng.new_cache(), rows=[len(ids) - 1])
        eng.backend.synchronize()
        return prefill / (time.perf_counter() - t)

    def one_decode():
        res = GenerationResult()
        for _ in eng.generate_ids(ids[:8], max_tokens=decode, ignore_eos=True, result=res):
            pass
        eng.backend.synchronize()
        return decode / res.decode_s

    counted = _paths()
    counted.clear()
    speeds = _speeds(one_prefill, one_decode, repeats)
    wi = eng.weights_info()
    paths = {f"{t}: {how}, {rows}": n for (t, how, rows), n in sorted(counted.items())}
    peak = _peak_mb()                # before vector_registers' fresh compile, which is not the engine's memory
    if backend == "numba" and os.environ.get("LLORCH_BENCH_VECTOR_REGISTERS", "1") != "0":
        from llorch_ref.backends.numba_backend import vector_registers
        eng.backend.info["vector_registers"] = vector_registers()      # after the timed runs
    return {"engine": f"llorch-ref {backend}" + (f" {dtype}" if dtype != "float32" else "")
            + (" ggml" if numerics == "ggml" else "") + (" lazy" if wi.get("lazy") else " eager"),
            "device": eng.backend.device, "load_s": load_s, **speeds, "peak_mb": peak, "info": {**eng.backend.info, "weights": wi, "matrix_paths": paths}}


def measure_llamacpp(path, prefill, decode, repeats, threads):
    tok = from_gguf_metadata(read_metadata(open_reader(path)))        # the vocabulary only, no weights
    ids = tok.encode(PROMPT)[:prefill] if tok is not None else list(range(1, prefill + 1))   # no vocabulary: ids
    import gc
    gc.collect()
    t0 = time.perf_counter()
    ref = LlamaCpp(path, n_ctx=max(512, prefill + decode + 16), kv_dtype="float16", n_threads=threads)
    load_s = time.perf_counter() - t0

    def one_prefill():
        t = time.perf_counter()
        ref.eval_last(ids)
        return prefill / (time.perf_counter() - t)

    def one_decode():                  # timed from the end of the prompt's forward, as measure_llorch is
        timing = {}
        ref.greedy(ids[:8], decode, timing=timing)
        return decode / timing["decode_s"]

    return {"engine": "llama.cpp", "device": "cpu", "load_s": load_s,
            **_speeds(one_prefill, one_decode, repeats),
            "peak_mb": _peak_mb(), "info": {"settings": ref.settings}}


def measure_transformers(path, prefill, decode, repeats, threads):
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(os.path.abspath(path)),
                                                 gguf_file=os.path.basename(path), torch_dtype=torch.float32)
    model.eval()
    load_s = time.perf_counter() - t0
    ids = torch.arange(1, prefill + 1)[None]

    def one_prefill():
        t = time.perf_counter()
        with torch.no_grad():
            model(ids)
        return prefill / (time.perf_counter() - t)

    from transformers import LogitsProcessor, LogitsProcessorList

    class FirstCall(LogitsProcessor):
        """Notes when the first token is chosen, i.e. when the prompt's forward has ended."""
        def __init__(self):
            self.t = None

        def __call__(self, input_ids, scores):
            self.t = self.t or time.perf_counter()
            return scores

    def one_decode():                  # timed from the end of the prompt's forward, as measure_llorch is
        first = FirstCall()
        with torch.no_grad():
            model.generate(ids[:, :8], max_new_tokens=decode, min_new_tokens=decode, do_sample=False,
                           logits_processor=LogitsProcessorList([first]))
        return (decode - 1) / (time.perf_counter() - first.t)     # the forwards after the first token

    return {"engine": "transformers (CPU, float32)", "device": "cpu", "load_s": load_s,
            **_speeds(one_prefill, one_decode, repeats),
            "peak_mb": _peak_mb(), "info": {"torch": torch.__version__}}


def worker_main(argv):
    """python -m llorch_ref.bench ENGINE PATH PREFILL DECODE REPEATS THREADS -> one JSON line."""
    engine, path, prefill, decode, repeats, threads = argv[0], argv[1], *map(int, argv[2:6])
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    if engine == "llamacpp":
        out = measure_llamacpp(path, prefill, decode, repeats, threads)
    elif engine == "transformers":
        out = measure_transformers(path, prefill, decode, repeats, threads)
    else:
        backend, _, dtype = engine.partition(":")
        numerics = "ggml" if backend.endswith("-ggml") else "exact"
        weights = {"numpy-eager": "eager", "numpy-lazy": "lazy"}.get(backend, "auto")
        backend = backend.split("-")[0]
        out = measure_llorch(path, backend, prefill, decode, repeats, threads, dtype or "float32", numerics, weights)
    print("BENCH " + json.dumps(out), flush=True)


def host_probe(threads, rounds=9) -> float:
    """The host's speed now: GFLOP/s of float32 matrix products in cache (384 x 384, BLAS on `threads` threads),
    the median of `rounds` rounds of about 30 ms. A shared host's cores run up to 2x slower for seconds at a time
    (results/cpu/2026-11-28-s16.md): run before each engine
    and after the last, it shows whether the engines were measured on the same machine speed."""
    from threadpoolctl import threadpool_limits

    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((384, 384)).astype(np.float32) for _ in range(2))
    took = []
    with threadpool_limits(threads):
        a @ b
        for _ in range(rounds):
            t0 = time.perf_counter()
            for _ in range(8):
                a @ b
            took.append((time.perf_counter() - t0) / 8)
    return round(2 * 384 ** 3 / statistics.median(took) / 1e9, 1)


def run_bench(path, engines, prefill=128, decode=128, repeats=3, threads=None, timeout=1800):
    threads = threads or os.cpu_count() or 1
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), OPENBLAS_NUM_THREADS=str(threads),
               MKL_NUM_THREADS=str(threads), NUMBA_NUM_THREADS=str(threads))
    results, probes = [], []
    for e in engines:
        probes.append(host_probe(threads))
        print(f"llorch-ref bench: {e} ...", file=sys.stderr, flush=True)
        cmd = [sys.executable, "-m", "llorch_ref.bench", e, str(path), str(prefill), str(decode), str(repeats),
               str(threads)]
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
        line = next((ln for ln in r.stdout.splitlines() if ln.startswith("BENCH ")), None)
        if r.returncode != 0 or line is None:
            tail = (r.stderr.strip().splitlines() or ["no output"])[-1]
            results.append({"engine": e, "error": tail})
            continue
        results.append(json.loads(line[6:]))
    probes.append(host_probe(threads))
    return {"model": str(path), "prefill_tokens": prefill, "decode_tokens": decode, "repeats": repeats,
            "threads": threads, "cpu_model": cpu_model(), "cpu_flags": cpu_flags(), "results": results,
            "host_probe_gflops": probes}


def _tps(x) -> str:
    """tokens/s with one decimal, or three significant digits below 1 (0.04 must not print as 0.0)."""
    return f"{x:.1f}" if x >= 1 else f"{x:.3g}"


def markdown(report) -> str:
    base = next((r for r in report["results"] if r.get("engine") == "llama.cpp" and "error" not in r), None)
    lines = [f"model `{os.path.basename(report['model'])}`, {report['threads']} threads, prefill "
             f"{report['prefill_tokens']} tokens, decode {report['decode_tokens']} tokens (EOS ignored), "
             f"medians of {report['repeats']}; CPU {report.get('cpu_model')} ({report.get('cpu_flags')})", "",
             "| engine | device | load s | prefill tok/s | decode tok/s | peak MB | prefill vs llama.cpp | "
             "decode vs llama.cpp |", "|---|---|---|---|---|---|---|---|"]
    for r in report["results"]:
        if "error" in r:
            lines.append(f"| {r['engine']} | - | - | - | - | - | error: {r['error']} | |")
            continue
        rp = f"{r['prefill_tok_s'] / base['prefill_tok_s']:.2f}x" if base else "-"
        rd = f"{r['decode_tok_s'] / base['decode_tok_s']:.2f}x" if base else "-"
        lines.append(f"| {r['engine']} | {r['device']} | {r['load_s']:.2f} | {_tps(r['prefill_tok_s'])} | "
                     f"{_tps(r['decode_tok_s'])} | {r['peak_mb']:.0f} | {rp} | {rd} |")
    spread = [f"{r['engine']} prefill {_tps(min(r['prefill_runs']))}-{_tps(max(r['prefill_runs']))}, decode "
              f"{_tps(min(r['decode_runs']))}-{_tps(max(r['decode_runs']))}"
              for r in report["results"] if r.get("prefill_runs") and r.get("decode_runs")]
    if spread:
        lines += ["", "run-to-run spread (tok/s, every timed run): " + "; ".join(spread)]
    lines += _probe_lines(report.get("host_probe_gflops"), [r["engine"] for r in report["results"]])
    for r in report["results"]:
        info = r.get("info") or {}
        if info.get("matrix_paths"):
            lines += ["", f"{r['engine']}: matrix products by path (every prefill and decode run): "
                      + "; ".join(f"{k} x{n}" for k, n in info["matrix_paths"].items())]
        if info.get("vector_registers"):
            lines += ["", f"{r['engine']}: compiled kernels' vector registers: "
                      + "; ".join(f"{k} {v}" for k, v in info["vector_registers"].items())]
    return "\n".join(lines)


def _probe_lines(probes, engines) -> list:
    """The host probe's figures, and a warning where they moved by more than a fifth during the run."""
    if not probes:
        return []
    when = [f"before {e} {p}" for e, p in zip(engines, probes)] + [f"after the last {probes[-1]}"]
    lines = ["", "host speed (float32 products in cache, GFLOP/s, host_probe): " + ", ".join(when)]
    if max(probes) > 1.2 * min(probes):
        lines.append(f"warning: the host's speed moved by {max(probes) / min(probes):.2f}x during this run; engines "
                     "measured at different speeds are not comparable: run again")
    return lines


if __name__ == "__main__":
    worker_main(sys.argv[1:])
