"""llorch-ref eval: corpus statistics of a subject against llorch-ref (numpy, exact unless asked) on --model, under
llama-perplexity's names, in-process or on Ray; a table, --json, and --report (plots)."""
from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

from rich.table import Table

from ..errors import ParameterError
from ..harness.corpus_eval import EvalResult, check_memory, corpus_ids, make_chunks, run_eval, text_file
from ..harness.eval_blackbox import round_trips, run_blackbox_eval
from ..harness.eval_report import write_report
from ..harness.ray_eval import check_cluster_address, run_eval_ray
from ..harness.text_safety import for_terminal
from ..loaders.corpus import NAME as DEFAULT_TEXT_NAME
from ..loaders.corpus import default_corpus_path
from ..loaders.default_model import resolve_model
from ..output_paths import check_output
from ..references.llamacpp import check_gpu_layers
from ..references.logit_sources import ENGINE_KINDS, SourceSpec
from .common import log
from .comparisons import is_blackbox
from .report import console_for

NAMED = ENGINE_KINDS + ("llamacpp", "transformers", "onnxruntime")


def subject_spec(args, base: Path) -> SourceSpec:
    """--subject NAME or DUMP, with the settings that apply to it; a setting that does not apply is an error."""
    kind = args.subject if args.subject in NAMED else "dump"
    model = str(resolve_model(args.subject_model) if args.subject_model else base)
    if kind == "dump":
        if not Path(args.subject).exists():
            raise ParameterError(f"--subject {args.subject}: neither one of {', '.join(NAMED)} nor a dump file/folder")
        model = args.subject
    given = {"numerics": args.numerics, "kv_dtype": args.kv_dtype, "flash_attn": args.flash_attn or None,
             "n_ubatch": args.ubatch, "threads": args.threads, "precision": args.precision,
             "n_gpu_layers": args.gpu_layers}
    allowed = {"numpy": {"numerics", "kv_dtype"}, "numba": {"numerics", "kv_dtype"}, "cupy": {"kv_dtype"},
               "llamacpp": {"kv_dtype", "flash_attn", "n_ubatch", "threads", "n_gpu_layers"}, "transformers": set(),
               "onnxruntime": {"precision"}, "dump": set()}[kind]
    bad = [k for k, v in given.items() if v is not None and k not in allowed]
    if bad:
        raise ParameterError(f"{', '.join('--' + k.replace('_', '-').replace('n-ubatch', 'ubatch').replace('n-gpu', 'gpu') for k in bad)}: "
                             f"not a setting of --subject {kind}")
    if kind == "dump" and args.subject_model:
        raise ParameterError("--subject-model does not apply to a dump (its logits are in the file)")
    return SourceSpec(kind, model, {k: v for k, v in given.items() if v is not None})


def cmd_eval(args):
    """Every check that can refuse the run comes before any work and any output: the outputs, the Ray
    address, the text file, the memory one chunk needs; then the text is read only as far as the chunks need."""
    base = resolve_model(args.model)
    if is_blackbox(args.subject):
        return cmd_eval_blackbox(args, base)
    spec = subject_spec(args, base)
    if spec.settings.get("n_gpu_layers"):
        check_gpu_layers(spec.settings["n_gpu_layers"])     # before any work: a CPU build is refused
    outs = check_outputs(args, base)
    if args.top_logprobs is not None:
        raise ParameterError("--top-logprobs: for a black-box --subject (openai:URL)")
    if args.ray is not None:
        check_cluster_address(args.ray or None)
    if args.reference_backend == "cupy" and args.reference_numerics != "exact":
        raise ParameterError(f"--reference-backend cupy computes the exact numerics only, not "
                             f"--reference-numerics {args.reference_numerics}")
    text_path = text_file(args.text) if args.text is not None else None
    ref = SourceSpec(args.reference_backend, str(base),
                     {} if args.reference_numerics == "exact" else {"numerics": args.reference_numerics})
    import llorch_ref
    eng = llorch_ref.load(base, weights="lazy")
    if eng.tokenizer is None:
        raise ParameterError(f"{base}: no vocabulary: eval needs a tokenizer for the text")
    memory = _memory_check(args, eng, spec)
    want = None if args.chunks is None else args.chunks * args.ctx
    memory(args.chunks or 1, want or 0)
    if text_path is None:
        text_path, text_name = default_corpus_path(), DEFAULT_TEXT_NAME
    else:
        text_name = str(text_path)
    tok = eng.tokenizer
    ids = corpus_ids(text_path, tok, want)
    chunks = make_chunks(ids, args.ctx, args.chunks, tok.bos_id if tok.add_bos else None)
    need = memory(len(chunks), len(ids))
    log(f"llorch-ref: {len(chunks)} chunks of {args.ctx} tokens from {text_name} ({len(ids)} tokens"
        f"{'' if args.chunks is None else ' read'}); subject {spec.label}, reference llorch-ref {ref.label}; "
        f"memory needed about {need / 1e9:.2f} GB")
    with _progress(len(chunks) * args.ctx) as bar:
        if args.ray is not None:
            res = run_eval_ray(spec, ref, chunks, text_name, address=args.ray or None, progress=bar)
        else:
            res = run_eval(spec, ref, chunks, text_name, progress=bar)
    out = res.to_json()
    print_statistics(out)
    write_outputs(out, outs, args, log)
    return 0


def write_outputs(out: dict, outs: dict, args, log) -> None:
    """The statistics to --json and --report, where asked (check_outputs made them safe to write)."""
    if "json" in outs:
        with outs["json"].staged_file() as tmp:
            tmp.write_text(json.dumps(out, indent=2) + "\n")
        log(f"llorch-ref: wrote {args.json}")
    if "report" in outs:
        write_report(out, outs["report"])
        log(f"llorch-ref: wrote {args.report}/report.md and report.html")


def check_outputs(args, base) -> dict:
    """--json and --report checked before any work."""
    outs = {}
    if args.json:
        outs["json"] = check_output(args.json, inputs=[base], overwrite=args.overwrite, what="--json")
    if args.report:
        outs["report"] = check_output(args.report, kind="folder", inputs=[base], overwrite=args.overwrite,
                                      what="--report",
                                      owned=("report.md", "report.html", "kld_by_position.png", "kld_histogram.png"))
    return outs


def cmd_eval_blackbox(args, base: Path):
    """eval --subject openai:URL | mistralrs: the scored positions' distributions from what the engine serves
    (harness/eval_blackbox.py), against llorch-ref on --model in --reference-numerics; the method and its cost
    said beside the statistics."""
    import tempfile

    import llorch_ref

    given = [f for f, on in (("--subject-model", args.subject_model), ("--numerics", args.numerics),
                             ("--kv-dtype", args.kv_dtype), ("--flash-attn", args.flash_attn),
                             ("--ubatch", args.ubatch), ("--precision", args.precision), ("--ray", args.ray is not None),
                             ("--gpu-layers", args.gpu_layers is not None),
                             ("--reference-backend", args.reference_backend != "numpy")) if on]
    if given:
        raise ParameterError(f"{', '.join(given)}: not a setting of a black-box --subject (the engine runs as it "
                             f"is served; mistral.rs loads --model)")
    outs = check_outputs(args, base)
    text_path = text_file(args.text) if args.text is not None else None
    eng = llorch_ref.load(base, numerics=args.reference_numerics, threads=args.threads)
    if eng.tokenizer is None:
        raise ParameterError(f"{base}: no vocabulary: eval needs a tokenizer for the text")
    if text_path is None:
        text_path, text_name = default_corpus_path(), DEFAULT_TEXT_NAME
    else:
        text_name = str(text_path)
    tok = eng.tokenizer
    want = None if args.chunks is None else 2 * args.chunks * args.ctx      # room for chunks that do not round trip
    ids = corpus_ids(text_path, tok, want)
    chunks, left = round_trips(tok, make_chunks(ids, args.ctx, None, tok.bos_id if tok.add_bos else None), args.chunks,
                               prefixes=args.subject == "mistralrs")     # mistral.rs is asked prefix by prefix
    if not chunks:
        raise ParameterError(f"no chunk of {args.ctx} tokens of {text_name} tokenizes back from its text: a black box "
                             f"is sent text")
    log(f"llorch-ref: {len(chunks)} chunks of {args.ctx} tokens from {text_name} ({left} left out whose text "
        f"tokenizes otherwise); subject {args.subject}, reference llorch-ref {args.reference_numerics}")
    t0 = time.perf_counter()
    with _progress(len(chunks) * args.ctx) as bar, tempfile.TemporaryDirectory() as d:
        scores, how = run_blackbox_eval(args.subject, eng, chunks, args.top_logprobs, args.timeout, d, progress=bar)
    dt = time.perf_counter() - t0
    how["chunks_left_out"] = left
    res = EvalResult(args.subject, f"llorch-ref numpy ({args.reference_numerics})", text_name, args.ctx, scores,
                     {"load_s": 0.0, "eval_s": dt, "tokens_per_s": None, "engine_s": how["engine_s"],
                      "reference_s": how["reference_s"]})
    out = {**res.to_json(), "blackbox": how}
    print_statistics(out)
    console_for(None).print(for_terminal(method_line(how)))
    write_outputs(out, outs, args, log)
    return 0


def method_line(how: dict) -> str:
    """How a black box's distributions were had, and what it cost."""
    what = {"echo": "echo (one request a chunk: the prompt's own log-probabilities)",
            "prefix": "one-token requests over each scored position's prefix"}[how["method"]]
    return (f"method: {what}; {how['requests']} requests" + (f" and {how['tokenize_requests']} tokenize checks"
            if how.get("tokenize_requests") else "") + f", {how['engine_s']:.1f} s waiting for the engine, "
            f"{how['reference_s']:.1f} s for the reference; {how['positions']} positions scored, "
            f"{how['chunks_dropped']} chunks left out ({how['skipped_positions']} positions tokenized otherwise); "
            f"KLD {how['kld']}; -log q(target) bounded (not listed) at {how['nll_bounded']}"
            + (" (PPL(Q) and the Δp figures are then bounds too: ask more --top-logprobs)" if how["nll_bounded"]
               else "")
            + (f"; echo refused: {how['echo_refused']}" if how["method"] == "prefix" and how.get("echo_refused")
               else ""))


def _memory_check(args, eng, spec):
    """check_memory for this run, as a function of the chunks and the ids read: the base model's shape, its
    dequantized weights on each side that holds them in this host's memory (a dump holds none; a cupy side
    holds them here only while it loads, one side at a time, then on the GPU), and the processes of a local Ray
    (one actor a core, or a GPU with a cupy side; at most one a chunk); a remote cluster's nodes are not this
    machine's memory."""
    weights = int(eng.weights_info()["dequantized_mb"] * 2**20)
    on_gpu = "cupy" in (spec.kind, args.reference_backend)       # a local Ray: one actor a GPU
    sides = (spec.kind not in ("dump", "cupy")) + (args.reference_backend != "cupy") + on_gpu

    def check(n_chunks, text_tokens):
        processes = min(n_chunks, (gpu_count() if on_gpu else os.cpu_count()) or 1) if args.ray == "" else 1
        return check_memory(eng.config, weights, args.ctx, n_chunks, sides, processes, text_tokens)
    return check


def gpu_count() -> int:
    """The GPUs CuPy sees here (0 without CuPy or a device)."""
    try:
        import cupy
        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:
        return 0


class _progress:
    """tqdm over tokens (tokens/s and ETA), on stderr; a no-op callable when stderr is not a terminal."""

    def __init__(self, total):
        self.total, self.bar = total, None

    def __enter__(self):
        from tqdm import tqdm
        self.bar = tqdm(total=self.total, unit="tok", unit_scale=True, file=sys.stderr, disable=not sys.stderr.isatty(),
                        desc="eval")
        return self.bar.update

    def __exit__(self, *exc):
        self.bar.close()


def _fmt(v, pct=False):
    if isinstance(v, (list, tuple)):
        a, b = v
        return f"{100 * a:.3f} ± {100 * b:.3f} %" if pct else f"{a:.6f} ± {b:.6f}"
    if isinstance(v, float):
        return f"{100 * v:.3f} %" if pct else ("nan" if math.isnan(v) else f"{v:.6f}")
    return str(v)


def print_statistics(out: dict, file=None):
    """llama-perplexity's three blocks under its names (Δp and Same top p in percent, as it prints them)."""
    con = console_for(file)
    t = Table(title=for_terminal(f"{out['subject']} vs {out['reference']}: {out['chunks']} chunks of {out['ctx']} "
                                 f"tokens, {out['statistics']['scored tokens']} scored ({out['where']})"))
    t.add_column("statistic")
    t.add_column("value")
    for k, v in out["statistics"].items():
        pct = "Δp" in k or k == "Same top p" or k.startswith("Reference top")
        t.add_row(k, _fmt(v, pct) if k != "Cor(ln(PPL(Q)), ln(PPL(base)))" else f"{100 * v:.2f}%")
    con.print(t)
    tm = out["timings"]
    if tm.get("tokens_per_s"):
        split = ", ".join(f"{k[:-2]} {tm[k]:.1f} s" for k in ("subject_s", "reference_s", "scoring_s") if k in tm)
        con.print(f"throughput: {tm['tokens_per_s']:.0f} tokens/s (both sides, after {tm['load_s']:.1f} s loading"
                  f"{'; ' + split if split else ''})")
