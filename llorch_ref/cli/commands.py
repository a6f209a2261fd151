"""The commands that run one model: generate, chat, inspect, convert, dump, serve, bench."""
from __future__ import annotations

import json
import os
import sys
import time
from collections import Counter
from pathlib import Path

from ..bench import markdown, run_bench
from ..convert import convert_gguf, convert_gguf_to_hf, convert_hf_to_gguf
from ..dump import parse_rows
from ..engine import GenerationResult
from ..errors import ParameterError
from ..harness.run import DEFAULT_PROMPT
from ..harness.text_safety import for_terminal
from ..loaders.default_model import resolve_model
from ..output_paths import check_output
from ..references.engines import dump_llamacpp, dump_transformers, hf_tokenize
from ..references.llamacpp import check_gpu_layers
from ..references.llamacpp import tokenize as llamacpp_tokenize
from ..references.llorch import record_engine
from ..references.onnx_runtime import dump_onnxruntime
from .common import api_token, load_engine, log, sampling_kwargs
from .report import report_generation


def cmd_generate(args):
    eng = load_engine(args)
    res = GenerationResult()
    out = sys.stdout
    for piece in eng.generate(args.prompt, max_tokens=args.max_tokens, chat=args.chat, system=args.system,
                              ignore_eos=args.ignore_eos, stop=args.stop, result=res, **sampling_kwargs(args)):
        out.write(piece)
        out.flush()
    out.write("\n")
    out.flush()
    report_generation(res)
    return 0


def cmd_chat(args):
    """Interactive multi-turn chat with the model's template; the whole conversation is re-encoded each turn."""
    eng = load_engine(args)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    interactive = sys.stdin.isatty()
    log("llorch-ref chat: type a message and press Enter; an empty line or Ctrl-D ends the chat")
    while True:
        if interactive:
            print("> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line or not line.strip():
            return 0
        messages.append({"role": "user", "content": line.rstrip("\n")})
        res = GenerationResult()
        for piece in eng.generate(messages=messages, max_tokens=args.max_tokens, stop=args.stop, result=res,
                                  **sampling_kwargs(args)):
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
        sys.stdout.flush()
        messages.append({"role": "assistant", "content": res.text})
        report_generation(res)


def say(line: str):
    """One line on stdout, every character a terminal would act on escaped (names and tokens come from the file)."""
    print(for_terminal(line))


def cmd_inspect(args):
    eng = load_engine(args)
    c = eng.config
    tok = eng.tokenizer
    say(f"file:            {eng.path}")
    say(f"architecture:    {c.arch}  ({c.extra.get('general.name')})")
    for k, v in c.to_dict().items():
        say(f"  {k:<18} {v}")
    say(f"  {'n_rep (GQA)':<18} {c.n_rep}")
    say("tensors by type: " + ", ".join(f"{t}: {n}" for t, n in sorted(Counter(eng.tensor_types.values()).items())))
    say(f"tensor count:    {len(eng.tensor_types)}")
    if tok is None:
        say("vocabulary:      none (no_vocab): token ids only")
        return 0
    say(f"vocabulary:      {tok.n_vocab} tokens, model {tok.kind!r}, pre-tokenizer {tok.pre!r}")
    def name(i):
        return "none" if i is None else f"{i} {tok.tokens[i]!r}"
    say(f"BOS:             {name(tok.bos_id)} (add_bos={tok.add_bos})")
    say(f"EOS:             {name(tok.eos_id)} (add_eos={tok.add_eos})")
    say("end of generation: " + ", ".join(name(i) for i in sorted(tok.eog_ids)))
    specials = [i for i, t in enumerate(tok.token_types) if t in (3, 4)]
    say(f"special/control tokens ({len(specials)}): " + " ".join(tok.tokens[i] for i in specials[:40])
        + (" ..." if len(specials) > 40 else ""))
    say(f"chat template:   {'yes' if tok.chat_template else 'no'}")
    return 0


def cmd_convert(args):
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
    log(f"llorch-ref: wrote {out} ({size / 1e6:.1f} MB) in {time.perf_counter() - t0:.1f} s")
    print(out)
    return 0


def cmd_dump(args):
    out = check_output(args.out, inputs=[resolve_model(args.model)], overwrite=args.overwrite, what="--out").path
    if args.engine == "llamacpp":
        check_gpu_layers(args.gpu_layers)         # before any work: a build without a GPU backend is refused
    ids = None
    if args.token_ids:
        try:
            ids = [int(x) for x in args.token_ids.split(",") if x.strip()]
        except ValueError:
            raise ParameterError(f"--token-ids {args.token_ids!r}: give comma-separated integers") from None
        if not ids:
            raise ParameterError("--token-ids is empty")
    prompt = None if ids is not None and args.prompt is None else (args.prompt or DEFAULT_PROMPT)
    if args.precision is not None and args.engine != "onnxruntime":
        raise ParameterError("--precision applies to --engine onnxruntime")
    if args.rows is not None and args.engine not in ("llorch", "onnxruntime") and ids is None:   # rows count tokens
        ids = (llamacpp_tokenize(resolve_model(args.model), prompt) if args.engine == "llamacpp"
               else hf_tokenize(resolve_model(args.model), prompt))
    rows = parse_rows(args.rows, len(ids)) if ids is not None else None
    if args.engine != "llamacpp":
        lcp = [f for f, on in (("--flash-attn", args.flash_attn), ("--tiled-mm", args.tiled_mm),
                               ("--ubatch", args.ubatch is not None and args.engine == "llorch"),
                               ("--threads", args.threads is not None),
                               ("--gpu-layers", args.gpu_layers is not None)) if on]
        if lcp:
            raise ParameterError(f"{', '.join(lcp)}: llama.cpp settings, for --engine llamacpp (--ubatch: llamacpp and transformers)")
    if args.engine != "llorch":
        given = [f"--{k.replace('_', '-')} {v}" for k, v, d in (("backend", args.backend, None),
                 ("dtype", args.dtype, "float32"), ("numerics", args.numerics, None),
                 ("ggml_simd", args.ggml_simd, "auto")) if v != d]
        if args.engine == "transformers" and args.kv_dtype not in (None, "float32"):
            given.append(f"--kv-dtype {args.kv_dtype}")
        if given:
            raise ParameterError(f"{', '.join(given)} do(es) not apply to --engine {args.engine}")
    if args.engine == "llamacpp":
        if args.tiled_mm:
            os.environ["GGML_CPU_TILED_MM"] = "1"      # read once, before llama.cpp's first product
        rec = dump_llamacpp(resolve_model(args.model), prompt=prompt, token_ids=ids, n_greedy=args.greedy,
                            decode_steps=args.decode_steps,
                            kv_dtype=args.kv_dtype or "float32", checkpoints=args.checkpoint, flash_attn=args.flash_attn,
                            n_ubatch=args.ubatch or 512, n_threads=args.threads or 2, rows=rows,
                            n_gpu_layers=args.gpu_layers or 0)
    elif args.engine == "onnxruntime":
        if args.checkpoint:
            raise ParameterError("--checkpoint applies to llamacpp and llorch dumps; onnxruntime dumps hold all")
        if args.kv_dtype not in (None, "float32"):
            raise ParameterError(f"--kv-dtype {args.kv_dtype} does not apply to --engine onnxruntime (float32 cache)")
        rec = dump_onnxruntime(resolve_model(args.model), prompt=prompt, token_ids=ids, n_greedy=args.greedy,
                               decode_steps=args.decode_steps, rows=args.rows, precision=args.precision or "fp32")
    elif args.engine == "transformers":
        if args.checkpoint:
            raise ParameterError("--checkpoint applies to llamacpp and llorch dumps; transformers dumps hold all")
        rec = dump_transformers(resolve_model(args.model), prompt=prompt, token_ids=ids, n_greedy=args.greedy,
                                decode_steps=args.decode_steps, rows=rows, n_ubatch=args.ubatch)
    else:
        if args.checkpoint:
            raise ParameterError("--checkpoint applies to llamacpp dumps")
        eng = load_engine(args)
        if ids is None:
            if eng.tokenizer is None:
                raise ParameterError("this model has no vocabulary: pass --token-ids")
            ids = eng.tokenizer.encode(prompt)
        rec = record_engine(eng, ids, prompt=prompt, n_greedy=args.greedy, decode_steps=args.decode_steps,
                            rows=parse_rows(args.rows, len(ids)))
    rec.save(out, overwrite=args.overwrite)
    steps = len(rec.extra.get("decode_token_ids", []))
    print(f"wrote {out}: {len(rec.tensors)} tensors from {rec.engine} {rec.version}, {len(rec.token_ids)} tokens"
          + (f" and {steps} decode steps" if steps else "") + f", layouts {rec.layouts}")
    return 0


def cmd_serve(args):
    from ..server.app import create_app  # the web stack (fastapi, uvicorn) only for serve
    from ..server.connections import make_server, raise_open_file_limit

    token = api_token(args)
    eng = load_engine(args)
    app = create_app(eng, api_token=token, max_queue=args.max_queue)
    if token is None and args.host not in ("127.0.0.1", "localhost", "::1"):
        log(f"llorch-ref: warning: serving on {args.host} without a token: anyone who can reach this address can "
             f"run generations (set $LLORCH_API_TOKEN or --api-token-file)")
    log(f"llorch-ref: serving on http://{args.host}:{args.port} (POST /execute, /tokenize, "
         f"/v1/completions, /v1/chat/completions; GET /health, /v1/models){'; bearer token required' if token else ''}")
    raise_open_file_limit()
    make_server(app, args.host, args.port, shutdown_grace=args.shutdown_grace).run()
    return 0


def cmd_bench(args):
    path = resolve_model(args.model)
    if not path.exists():
        raise ParameterError(f"{path}: no such file")
    if args.json:
        json_out = check_output(args.json, inputs=[path], overwrite=args.overwrite, what="--json")
    engines = [e for e in args.engines.split(",") if e]
    if not engines:
        raise ParameterError("--engines names no engine (give e.g. numba,llamacpp)")
    known = {"numpy", "numpy-eager", "numpy-lazy", "numpy-ggml", "numba", "numba-ggml", "cupy", "cupy:float16", "llamacpp",
             "transformers"}
    bad = [e for e in engines if e not in known]
    if bad:
        raise ParameterError(f"unknown engine(s) {', '.join(bad)}; known: {', '.join(sorted(known))}")
    if args.weight_cache_mb is not None:
        if args.weight_cache_mb < 0:
            raise ParameterError("--weight-cache-mb must be >= 0")
        if not any(e in ("numpy", "numpy-lazy", "numba") for e in engines):
            raise ParameterError("--weight-cache-mb applies to the lazy-weight engines (numpy, numpy-lazy, numba)")
        os.environ["LLORCH_BENCH_WEIGHT_CACHE_MB"] = str(args.weight_cache_mb)
    report = run_bench(path, engines, prefill=args.prefill, decode=args.decode, repeats=args.repeats,
                       threads=args.threads, interleave=args.interleave)
    md = markdown(report)
    print(md)
    if args.json:
        with json_out.staged_file() as tmp:
            tmp.write_text(json.dumps(report, indent=2) + "\n")
        log(f"llorch-ref: wrote {args.json}")
    return 0 if all("error" not in r for r in report["results"]) else 1
