"""`llorch-ref bench`: load time, prefill and decode speed, peak memory, for each engine on one file.

Each engine runs in its own process (so peak resident memory is its own), with the same thread count:
llorch-ref backends (numpy, numba, cupy), llama.cpp (llama-cpp-python, low-level API), and transformers
on the CPU when asked. Prefill: one forward over a PREFILL-token prompt (logits of the last row).
Decode: DECODE greedy tokens after an 8-token prompt, EOS ignored, timed from the end of the prompt's
forward (every engine: the prompt's prefill is not in the decode figure). Medians of REPEATS runs after one
warm-up, each run asked of the engine's process by this one (bench.serve); the load, one sample a process, the
median of REPEATS loads (REPEATS - 1 more fresh processes that only load); the warm-ups' time beyond a warm run
is what the load left to the first request (after_load_s, beside load_s); GPU work is synchronized before each
clock read. Output: a JSON file and a Markdown table with ratios to llama.cpp. The engines run one after another,
or with --interleave all loaded (one after another) and kept loaded, timed in rounds back to back (run_interleaved), each ratio then the
median of the rounds' ratios.
"""
from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from llorch_ref.backends import blas_info, cpu_flags, cpu_model
from llorch_ref.engine import GenerationResult
from llorch_ref.loaders.gguf_file import open_reader, read_metadata
from llorch_ref.numerics.ggml_build import simd_of
from llorch_ref.references.llamacpp import LlamaCpp
from llorch_ref.tokenizer import from_gguf_metadata

PROMPT = ("The history of the world is long and full of surprises. Rivers change their course, cities rise "
          "and fall, and people keep telling stories about all of it. ") * 12


def _peak_mb() -> float:
    """This process's peak resident memory in MB (10^6 bytes; Linux gives ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e6


def _model_mb(path) -> float | None:
    """The model's bytes in MB: a file's size, or a folder's files summed (None where the path is not there)."""
    p = Path(path)
    if p.is_file():
        return p.stat().st_size / 1e6
    if p.is_dir():
        return sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) / 1e6
    return None


def compiled_from_source(before, since) -> list:
    """The modules imported since `before` (a copy of sys.modules) whose source Python compiled then, finding
    no bytecode to read: its cached file absent (PYTHONDONTWRITEBYTECODE set over packages installed without it) or
    written after `since` (time.time()). A normal install leaves bytecode that later starts read; an environment
    without it compiles those modules in every process, inside whatever load imports them. -> sorted names"""
    out, known = [], {id(m) for m in before.values()}
    for name, module in list(sys.modules.items()):
        if name in before or id(module) in known:          # __mp_main__: __main__ under a second name
            continue
        spec = getattr(module, "__spec__", None)
        cached = getattr(spec, "cached", None)
        if not cached or not str(getattr(spec, "origin", "")).endswith(".py"):
            continue
        try:
            fresh = os.stat(cached).st_mtime >= since
        except OSError:
            fresh = True
        if fresh:
            out.append(name)
    return sorted(out)


@contextmanager
def timed_load():
    """Times the load in its block -> a dict, filled when the block ends: load_s (seconds) and compiled_at_load (the
    modules the block imported and compiled from source: compiled_from_source). One clock for every engine."""
    before, since, out = dict(sys.modules), time.time(), {}
    t0 = time.perf_counter()
    yield out
    out["load_s"] = time.perf_counter() - t0
    out["compiled_at_load"] = compiled_from_source(before, since)


def _paths():
    """The numba backend's count of matrix products by path (an empty one without numba)."""
    try:
        from llorch_ref.backends.numba_backend import PATHS
    except ImportError:
        return Counter()
    return PATHS


def open_llorch(path, backend, prefill, decode, threads, dtype="float32", numerics="exact", weights="auto"):
    """Load a llorch-ref engine -> (head, one_prefill, one_decode, tail) (see open_engine)."""
    import llorch_ref

    cache_mb = os.environ.get("LLORCH_BENCH_WEIGHT_CACHE_MB")
    with timed_load() as load:
        eng = llorch_ref.load(path, backend=backend, threads=threads, dtype=dtype, numerics=numerics,
                              weights=weights, weight_cache_mb=float(cache_mb) if cache_mb and weights != "eager" else None)
        eng.backend.synchronize()
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
    held = ("; held to one thread while a prompt runs on the kernels"
            if getattr(eng.backend, "prompts_in_place", False) else "")

    def tail():
        wi = eng.weights_info()
        paths = {f"{t}: {how}, {rows}": n for (t, how, rows), n in sorted(counted.items())}
        peak = _peak_mb()                # before vector_registers' fresh compile, which is not the engine's memory
        if backend == "numba":           # kernels compiled on first use (a cold cache): in after_load_s
            from llorch_ref.backends.numba_backend import kernels_compiled
            eng.backend.info["kernels_compiled_after_load"] = kernels_compiled() - eng.backend.info["kernels_compiled"]
        if backend == "numba" and os.environ.get("LLORCH_BENCH_VECTOR_REGISTERS", "1") != "0":
            from llorch_ref.backends.numba_backend import vector_registers
            eng.backend.info["vector_registers"] = vector_registers()      # after the timed runs
        return {"engine": f"llorch-ref {backend}" + (f" {dtype}" if dtype != "float32" else "")
                + (f" ggml ({eng.ggml_simd}) blocks" if numerics == "ggml" else " lazy" if wi.get("lazy") else " eager"),
                "peak_mb": peak, "info": {**eng.backend.info, "weights": wi, "matrix_paths": paths,
                                          "blas_kernels": blas_info() + held}}
    return {"device": eng.backend.device, **load}, one_prefill, one_decode, tail


def open_llamacpp(path, prefill, decode, threads):
    tok = from_gguf_metadata(read_metadata(open_reader(path)))        # the vocabulary only, no weights
    ids = tok.encode(PROMPT)[:prefill] if tok is not None else list(range(1, prefill + 1))   # no vocabulary: ids
    import gc
    gc.collect()
    with timed_load() as load:
        ref = LlamaCpp(path, n_ctx=max(512, prefill + decode + 16), kv_dtype="float16", n_threads=threads)

    def one_prefill():
        t = time.perf_counter()
        ref.eval_last(ids)
        return prefill / (time.perf_counter() - t)

    def one_decode():                  # timed from the end of the prompt's forward, as open_llorch's is
        timing = {}
        ref.greedy(ids[:8], decode, timing=timing)
        return decode / timing["decode_s"]

    head = {"engine": "llama.cpp", "device": "cpu", **load}
    return head, one_prefill, one_decode, lambda: {"peak_mb": _peak_mb(), "info": {"settings": ref.settings}}


def open_transformers(path, prefill, decode, threads):
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    with timed_load() as load:
        model = AutoModelForCausalLM.from_pretrained(os.path.dirname(os.path.abspath(path)),
                                                     gguf_file=os.path.basename(path), torch_dtype=torch.float32)
        model.eval()
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

    def one_decode():                  # timed from the end of the prompt's forward, as open_llorch's is
        first = FirstCall()
        with torch.no_grad():
            model.generate(ids[:, :8], max_new_tokens=decode, min_new_tokens=decode, do_sample=False,
                           logits_processor=LogitsProcessorList([first]))
        return (decode - 1) / (time.perf_counter() - first.t)     # the forwards after the first token

    head = {"engine": "transformers (CPU, float32)", "device": "cpu", **load}
    return head, one_prefill, one_decode, lambda: {"peak_mb": _peak_mb(), "info": {"torch": torch.__version__}}


def open_engine(engine, path, prefill, decode, threads):
    """Load one engine in this process -> (head, one_prefill, one_decode, tail): head {engine, device, load_s},
    each one_* a timed run's tokens/s, tail() the figures read after the runs (peak memory, info)."""
    if engine == "llamacpp":
        return open_llamacpp(path, prefill, decode, threads)
    if engine == "transformers":
        return open_transformers(path, prefill, decode, threads)
    backend, _, dtype = engine.partition(":")
    numerics = "ggml" if backend.endswith("-ggml") else "exact"
    weights = {"numpy-eager": "eager", "numpy-lazy": "lazy"}.get(backend, "auto")
    return open_llorch(path, backend.split("-")[0], prefill, decode, threads, dtype or "float32", numerics, weights)


def serve(subject, stdin=sys.stdin, stdout=sys.stdout):
    """An engine's process: "READY", then one timed run per "prefill" or "decode" line read ("RUN <tok/s>"), and at
    "end" the report's other figures ("BENCH <json>"). The parent (_served_runs) decides the warm-ups and rounds."""
    head, one_prefill, one_decode, tail = subject
    print("READY", file=stdout, flush=True)
    for line in stdin:
        cmd = line.strip()
        if cmd == "end":
            break
        print(f"RUN {(one_prefill if cmd == 'prefill' else one_decode)()!r}", file=stdout, flush=True)
    print("BENCH " + json.dumps({**head, **tail()}), file=stdout, flush=True)


def worker_main(argv):
    """python -m llorch_ref.bench ENGINE PATH PREFILL DECODE THREADS serve|load: one engine loaded, then served (see
    serve), or only its load's seconds printed ("LOAD <s>": one more sample of the load, in a fresh process)."""
    engine, path, prefill, decode, threads = argv[0], argv[1], *map(int, argv[2:5])
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    subject = open_engine(engine, path, prefill, decode, threads)
    if argv[5:] == ["load"]:
        print(f"LOAD {subject[0]['load_s']!r} {len(subject[0]['compiled_at_load'])}", flush=True)
        return
    serve(subject)


def host_probe(threads, rounds=9) -> float:
    """The host's speed now: GFLOP/s of float32 matrix products in cache (384 x 384, BLAS on `threads` threads),
    the median of `rounds` rounds of about 30 ms. A shared host's cores run up to 2x slower for seconds at a time:
    run before each engine and after the last, it shows whether the engines were measured on the same machine
    speed."""
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


def _env(threads):
    return dict(os.environ, OMP_NUM_THREADS=str(threads), OPENBLAS_NUM_THREADS=str(threads),
                MKL_NUM_THREADS=str(threads), NUMBA_NUM_THREADS=str(threads))


def _command(e, path, prefill, decode, threads):
    return [sys.executable, "-m", "llorch_ref.bench", e, str(path), str(prefill), str(decode), str(threads)]


def run_bench(path, engines, prefill=128, decode=128, repeats=3, threads=None, timeout=1800, interleave=False):
    """Each engine in its own process, one after another (interleave: all kept loaded at once, their timed runs taking
    turns: see run_interleaved) -> the report."""
    threads = threads or os.cpu_count() or 1
    report = {"model": str(path), "model_mb": _model_mb(path), "prefill_tokens": prefill, "decode_tokens": decode,
              "repeats": repeats, "threads": threads, "cpu_model": cpu_model(), "cpu_flags": cpu_flags()}
    if interleave:
        return {**report, **run_interleaved(path, engines, prefill, decode, repeats, threads, timeout)}
    results, probes = [], []
    for e in engines:
        probes.append(host_probe(threads))
        results += _served_runs(path, [e], prefill, decode, repeats, threads, timeout)
    probes.append(host_probe(threads))
    return {**report, "results": results, "host_probe_gflops": probes}


class _Served:
    """One engine process of an interleaved run: its stdin takes "prefill", "decode" or "end" (bench.serve)."""

    def __init__(self, e, cmd, threads, err):
        self.name, self.err = e, err
        self.proc = subprocess.Popen(cmd + ["serve"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                                     text=True, env=_env(threads))
        self.runs = {"prefill": [], "decode": []}
        self.first = {}                  # kind -> the warm-up run's tokens/s: the first run after the load
        self.error = None if self._read("READY") is not None else self._failed()

    def _read(self, tag):
        for line in self.proc.stdout:
            if line.startswith(tag):
                return line[len(tag):].strip()
        return None

    def _failed(self):
        """The process's last line on stderr (or that it was killed: the run's timeout)."""
        if self.proc.wait() < 0:
            return f"killed (signal {-self.proc.returncode}): the run's timeout, or the system"
        self.err.seek(0)
        return (self.err.read().decode(errors="replace").strip().splitlines() or ["no output"])[-1]

    def ask(self, cmd):
        """One timed run -> tokens/s (None, with self.error set, if the process failed)."""
        try:
            self.proc.stdin.write(cmd + "\n")
            self.proc.stdin.flush()
        except OSError:
            pass
        got = self._read("RUN ")
        if got is None:
            self.error = self._failed()
            return None
        return float(got)

    def finish(self) -> dict:
        try:
            self.proc.stdin.write("end\n")
            self.proc.stdin.close()
        except OSError:
            pass
        got = self._read("BENCH ")
        if got is None:
            return {"engine": self.name, "error": self._failed()}
        self.proc.wait()
        return json.loads(got)


def run_interleaved(path, engines, prefill, decode, repeats, threads, timeout=1800) -> dict:
    """Every engine loaded in its own process (one after another), then the timed runs in rounds: each round runs
    every engine once, back to back (the order reversed every other round), so that a ratio pairs runs made within
    seconds of each other on a host whose speed moves for tens of seconds at a time.
    -> {results, host_probe_gflops (before the loads, before the rounds, after), interleaved}"""
    probes = [host_probe(threads)]
    results = _served_runs(path, engines, prefill, decode, repeats, threads, timeout, probes)
    _round_ratios(results)
    return {"results": results, "host_probe_gflops": probes, "interleaved": True}


def _served_runs(path, engines, prefill, decode, repeats, threads, timeout, probes=None) -> list:
    """The engines each loaded in its own process (bench.serve), then one warm-up run of each kind and `repeats`
    timed ones, in rounds over the engines (the order reversed every other round) -> each engine's result. probes:
    a list the host's speed is appended to before the rounds and after them."""
    import tempfile
    import threading

    served = []
    killer = threading.Timer(timeout, lambda: [s.proc.kill() for s in served])
    killer.start()
    with tempfile.TemporaryDirectory() as tmp:
        try:
            for i, e in enumerate(engines):
                print(f"llorch-ref bench: {e} (loading) ...", file=sys.stderr, flush=True)
                err = open(os.path.join(tmp, f"{i}.err"), "w+b")
                served.append(_Served(e, _command(e, path, prefill, decode, threads), threads, err))
            if probes is not None:
                probes.append(host_probe(threads))
            print(f"llorch-ref bench: timed rounds ({repeats}) of {', '.join(engines)} ...", file=sys.stderr, flush=True)
            for kind in ("prefill", "decode"):
                for r in range(-1, repeats):                 # round -1: the warm-up
                    for s in (served if r % 2 == 0 else served[::-1]):
                        if s.error is None:
                            tps = s.ask(kind)
                            if r >= 0 and tps is not None:
                                s.runs[kind].append(tps)
                            elif tps is not None:
                                s.first[kind] = tps
            if probes is not None:
                probes.append(host_probe(threads))
            tokens = {"prefill": prefill, "decode": decode}
            results = [{"engine": s.name, "error": s.error} if s.error else _served_result(s, tokens) for s in served]
            _more_loads(results, path, prefill, decode, repeats, threads, timeout)
            return results
        finally:
            killer.cancel()
            for s in served:
                if s.proc.poll() is None:
                    s.proc.kill()
                s.err.close()


def _more_loads(results, path, prefill, decode, repeats, threads, timeout):
    """A load is one sample per process: repeats - 1 more fresh processes per engine only load it (in rounds over
    the engines, after the served ones have exited), and load_s becomes the median of all (load_runs)."""
    ok = [r for r in results if "error" not in r]
    for r in ok:
        r["load_runs"], r["compiled_at_load_runs"] = [round(r["load_s"], 4)], [len(r.get("compiled_at_load", ()))]
    for _ in range(repeats - 1):
        for r in ok:
            cmd = _command(r["bench_engine"], path, prefill, decode, threads) + ["load"]
            got = subprocess.run(cmd, capture_output=True, text=True, env=_env(threads), timeout=timeout)
            line = next((x for x in got.stdout.splitlines() if x.startswith("LOAD ")), None)
            if got.returncode == 0 and line is not None:
                seconds, compiled = line[5:].split()
                r["load_runs"].append(round(float(seconds), 4))
                r["compiled_at_load_runs"].append(int(compiled))
    for r in ok:
        r["load_s"] = statistics.median(r["load_runs"])


def _served_result(s, tokens) -> dict:
    out = s.finish()
    if "error" in out:
        return out
    out["bench_engine"] = s.name             # the --engines name it was asked by
    for kind, runs in s.runs.items():
        out[f"{kind}_tok_s"], out[f"{kind}_runs"] = statistics.median(runs), [round(r, 3) for r in runs]
    out["first_runs_tok_s"] = {k: round(v, 3) for k, v in s.first.items()}
    out["after_load_s"] = after_load_s(out, tokens)
    return out


def after_load_s(result, tokens) -> float | None:
    """The one-time work a load leaves to the first request, in seconds: the first prefill's and the first decode's
    time beyond their warm medians' (kernels loaded on first use, the mapped weights' first touch, thread pools
    started), the same for every engine. A warm run's spread (a few percent of it) is in it, either sign."""
    first = result.get("first_runs_tok_s") or {}
    if set(first) != set(tokens) or not all(result.get(f"{k}_tok_s") for k in tokens):
        return None
    return round(sum(n / first[k] - n / result[f"{k}_tok_s"] for k, n in tokens.items()), 3)


def _round_ratios(results):
    """Each engine's runs over llama.cpp's run of the same round: {kind}_vs_llamacpp_runs."""
    base = next((r for r in results if r.get("engine") == "llama.cpp" and "error" not in r), None)
    for r in results:
        if base is None or "error" in r:
            continue
        for kind in ("prefill", "decode"):
            r[f"{kind}_vs_llamacpp_runs"] = [round(a / b, 3) for a, b in zip(r[f"{kind}_runs"], base[f"{kind}_runs"])]


def _tps(x) -> str:
    """tokens/s with one decimal, or three significant digits below 1 (0.04 must not print as 0.0)."""
    return f"{x:.1f}" if x >= 1 else f"{x:.3g}"


def _load(r) -> str:
    extra = r.get("after_load_s")
    return f"{r['load_s']:.2f}" + (f" ({extra:+.2f})" if extra is not None else "")


def _times(x, of) -> str:
    return f"{x / of:.2f}x" if of else "-"


def markdown(report) -> str:
    base = next((r for r in report["results"] if r.get("engine") == "llama.cpp" and "error" not in r), None)
    lines = [f"model `{os.path.basename(report['model'])}`, {report['threads']} threads, prefill "
             f"{report['prefill_tokens']} tokens, decode {report['decode_tokens']} tokens (EOS ignored), "
             f"medians of {report['repeats']}; CPU {report.get('cpu_model')} ({report.get('cpu_flags')})", "",
             "| engine | device | load s (+ left to the first runs) | prefill tok/s | decode tok/s | peak MB | peak vs model | prefill vs "
             "llama.cpp | decode vs llama.cpp |", "|---|---|---|---|---|---|---|---|---|"]
    model_mb = report.get("model_mb")
    for r in report["results"]:
        if "error" in r:
            lines.append(f"| {r['engine']} | - | - | - | - | - | - | error: {r['error']} | |")
            continue
        rp, rd = (_ratio(r, base, kind) for kind in ("prefill", "decode"))
        lines.append(f"| {r['engine']} | {r['device']} | {_load(r)} | {_tps(r['prefill_tok_s'])} | "
                     f"{_tps(r['decode_tok_s'])} | {r['peak_mb']:.0f} | {_times(r['peak_mb'], model_mb)} | {rp} | "
                     f"{rd} |")
    spread = [f"{r['engine']} prefill {_tps(min(r['prefill_runs']))}-{_tps(max(r['prefill_runs']))}, decode "
              f"{_tps(min(r['decode_runs']))}-{_tps(max(r['decode_runs']))}"
              + (f", load {min(r['load_runs']):.2f}-{max(r['load_runs']):.2f} s" if len(r.get("load_runs", ())) > 1
                 else "")
              for r in report["results"] if r.get("prefill_runs") and r.get("decode_runs")]
    if spread:
        lines += ["", "run-to-run spread (tok/s of every timed run; the loads' seconds, each in a fresh process): "
                  + "; ".join(spread)]
    if any(r.get("after_load_s") is not None for r in report["results"]):
        lines += ["", "load s (+ left to the first runs): the load, and the seconds its first prefill and first decode "
                  "took beyond warm ones (kernels loaded on first use, the weights' first touch: after_load_s)"]
    if report.get("interleaved"):
        paired = [f"{r['engine']} prefill {min(r['prefill_vs_llamacpp_runs']):.2f}-{max(r['prefill_vs_llamacpp_runs']):.2f}x"
                  f", decode {min(r['decode_vs_llamacpp_runs']):.2f}-{max(r['decode_vs_llamacpp_runs']):.2f}x"
                  for r in report["results"] if r.get("decode_vs_llamacpp_runs") and r["engine"] != "llama.cpp"]
        lines += ["", "interleaved: the engines loaded one after another and kept loaded, each round running every "
                  "engine back to back; the "
                  "ratios are medians of each round's ratio to llama.cpp"
                  + (" (per round: " + "; ".join(paired) + ")" if paired else "")]
        lines += _probe_lines(report.get("host_probe_gflops"), ["the loads", "the rounds"], paired=True)
    else:
        lines += _probe_lines(report.get("host_probe_gflops"), [r["engine"] for r in report["results"]])
    for r in report["results"]:
        info = r.get("info") or {}
        lines += _source_compiled_lines(r)
        if info.get("kernels_compiled"):
            lines += ["", f"warning: {r['engine']} compiled {info['kernels_compiled']} kernel signatures while loading "
                      f"(numba's cache was cold or stale): its load of {r['load_s']:.2f} s is mostly compile "
                      f"({info.get('compile_or_cache_load_s', 0):.1f} s); run again for a cached load"]
        if info.get("kernels_compiled_after_load"):
            lines += ["", f"warning: {r['engine']} compiled {info['kernels_compiled_after_load']} kernel signatures on "
                      f"first use (numba's cache was cold or stale): the {r.get('after_load_s') or 0:.1f} s left to its "
                      "first runs are mostly compile; run again for cached kernels"]
        if info.get("blas_kernels"):
            lines += ["", f"{r['engine']}: BLAS {info['blas_kernels']}"]
        build = (info.get("settings") or {}).get("build")
        if build is not None:
            lines += ["", f"{r['engine']}: its build's CPU features {' '.join(build) or 'none reported'}"
                      + _unused_simd(build, report.get("cpu_flags", ""))]
        if info.get("gomp_spincount"):
            lines += ["", f"{r['engine']}: prompts by {info.get('prompts', '?')}; numba's OpenMP workers spin "
                      f"{info['gomp_spincount']} times before sleeping (GOMP_SPINCOUNT)"]
        if info.get("matrix_paths"):
            lines += ["", f"{r['engine']}: matrix products by path (every prefill and decode run): "
                      + "; ".join(f"{k} x{n}" for k, n in info["matrix_paths"].items())]
        if info.get("vector_registers"):
            lines += ["", f"{r['engine']}: compiled kernels' vector registers: "
                      + "; ".join(f"{k} {v}" for k, v in info["vector_registers"].items())]
    return "\n".join(lines)


def _source_compiled_lines(r) -> list:
    """A warning where an engine's loads compiled Python source for want of bytecode (compiled_from_source)."""
    runs = r.get("compiled_at_load_runs") or [len(r.get("compiled_at_load") or ())]
    if not any(runs):
        return []
    packages = Counter(name.split(".")[0] for name in r.get("compiled_at_load") or ()).most_common()
    more = f" and {len(packages) - 4} more" if len(packages) > 4 else ""
    said = ", ".join(f"{p} {n}" for p, n in packages[:4]) + more
    return ["", f"warning: {r['engine']}'s load compiled Python modules that had no bytecode, in "
            f"{sum(n > 0 for n in runs)} of {len(runs)} loads ({max(runs)} modules at most"
            + (f"; the first load's by package: {said}" if said else "") + "): its load times include that compile "
            "(PYTHONDONTWRITEBYTECODE set over packages installed without bytecode repeats it in every process; "
            "`python -m compileall` over those packages writes it once)"]


def _unused_simd(build, cpu_flags) -> str:
    """What the CPU has that llama.cpp's build does not use (a portable wheel's one level), said beside its figures."""
    if "avx512f" in cpu_flags.split() and simd_of(build) != "avx512":
        return ("; this CPU has AVX-512, which this build does not use (a native build, CMAKE_ARGS=-DGGML_NATIVE=ON, "
                "would): the ratios above are against this build")
    return ""


def _ratio(r, base, kind) -> str:
    """An engine's speed over llama.cpp's: the median of the rounds' ratios when interleaved, else of the medians."""
    if base is None:
        return "-"
    if r.get(f"{kind}_vs_llamacpp_runs"):
        return f"{statistics.median(r[f'{kind}_vs_llamacpp_runs']):.2f}x"
    return f"{r[f'{kind}_tok_s'] / base[f'{kind}_tok_s']:.2f}x"


def _probe_lines(probes, engines, paired=False) -> list:
    """The host probe's figures, and a warning where they moved by more than a fifth during the run (paired: the
    ratios pair runs made back to back, a note instead)."""
    if not probes:
        return []
    when = [f"before {e} {p}" for e, p in zip(engines, probes)] + [f"after the last {probes[-1]}"]
    lines = ["", "host speed (float32 products in cache, GFLOP/s, host_probe): " + ", ".join(when)]
    if max(probes) > 1.2 * min(probes) and paired:
        lines.append(f"note: the host's speed moved by {max(probes) / min(probes):.2f}x during this run; each ratio "
                     "pairs runs made back to back, and the per-round ratios show how far it moved them")
    elif max(probes) > 1.2 * min(probes):
        lines.append(f"warning: the host's speed moved by {max(probes) / min(probes):.2f}x during this run; engines "
                     "measured at different speeds are not comparable: run again, or with --interleave (runs paired back to back)")
    return lines


if __name__ == "__main__":
    worker_main(sys.argv[1:])
