"""The comparison commands: diff and prove, over llama.cpp, transformers, the numpy oracle or a dump under
test (each a function of harness/run.py; the CLI only picks one and prints the result)."""
from __future__ import annotations

import json
import sys
import time

import llorch_ref

from ..checkpoints import engine_band_class
from ..dump import load_dump, parse_rows
from ..errors import ParameterError
from ..harness import run as harness_run
from ..harness.blackbox import compare_trace, divergence_lines, steps_table
from ..harness.bundle import check_bundle_target, load_signing_key, write_bundle
from ..harness.bundle_md import simd_phrase
from ..harness.compare import compare_dumps
from ..harness.run import DEFAULT_PROMPT
from ..harness.text_safety import for_terminal
from ..references.blackbox import mistralrs_trace, openai_trace
from ..references.engines import dump_transformers
from ..references.llamacpp import check_gpu_layers
from ..references.llorch import engine_label, record_engine
from .common import load_engine, log
from .report import _table, add_row, console_for, print_by_position, print_result


def run_comparison(args):
    """-> (engine, DiffResult) of the comparison the options describe; the result requires what --require says."""
    eng, res = _run_comparison(args)
    res.require = getattr(args, "require", "auto")
    res.verdict()                   # a --require naming nothing of this model is refused here, before any page
    return eng, res


def _run_comparison(args):
    not_here = [f for f, on in (("--rows", args.rows is not None), ("--ubatch", args.ubatch != 512),
                                               ("--batch", getattr(args, "batch", None) is not None),
                                               ("--gpu-layers", getattr(args, "gpu_layers", None) is not None)) if on]
    if not_here and (args.subject or args.reference != "llamacpp"):
        raise ParameterError(f"{', '.join(not_here)}: for a comparison with llama.cpp (a --subject dump holds its "
                             f"own rows and micro-batches: set them when writing it, with dump)")
    if getattr(args, "batch", None) is not None and args.batch < args.ubatch:
        raise ParameterError(f"--batch ({args.batch}) must be >= --ubatch ({args.ubatch}): llama.cpp runs a batch "
                             f"as micro-batches of --ubatch tokens")
    check_gpu_layers(getattr(args, "gpu_layers", None))      # before any work: a CPU build is refused
    args.prompt = DEFAULT_PROMPT if args.prompt is None else args.prompt
    if is_blackbox(getattr(args, "subject", None)):
        return run_blackbox(args)
    if getattr(args, "subject", None):
        return run_subject_dump(args)
    if getattr(args, "reference", "llamacpp") == "transformers":
        return run_transformers(args)
    if getattr(args, "band_class", None):
        raise ParameterError("--band-class applies to --subject and --reference transformers runs (a llama.cpp "
                             "run takes the band class from the weight types)")
    eng = load_engine(args)
    if getattr(args, "reference", "llamacpp") == "numpy":
        if eng.backend.name == "numpy":
            raise ParameterError("--reference numpy compares another backend with numpy: pass --backend numba|cupy")
        log("llorch-ref: running the numpy oracle and this backend, capturing every checkpoint ...")
        ref = llorch_ref.load(args.model, backend="numpy", n_ctx=getattr(args, "ctx", None))
        return eng, harness_run.run_backend_diff(eng, ref, prompt=args.prompt, checkpoints=args.checkpoint,
                                     n_greedy=args.greedy)
    if eng.tokenizer is None:
        raise ParameterError("this model has no vocabulary: the harness needs a text prompt")
    ids = eng.tokenizer.encode(args.prompt)
    rows = parse_rows(args.rows, len(ids))
    log(f"llorch-ref: running llama.cpp and the reference on {len(ids)} tokens"
        + (f" ({len(rows)} rows kept)" if rows else "") + ", capturing every checkpoint ...")
    return eng, harness_run.run_diff(eng, prompt=args.prompt, reference_model=args.reference_model,
                                     checkpoints=args.checkpoint, n_greedy=args.greedy, token_ids=ids, rows=rows,
                                     n_ubatch=args.ubatch, n_batch=getattr(args, "batch", None),
                                     n_gpu_layers=getattr(args, "gpu_layers", None) or 0)


def band_class_for(args, eng):
    return args.band_class or ("ggml" if eng.numerics == "ggml" else engine_band_class(eng))


def run_subject_dump(args):
    """--subject DUMP: the dump is under test; llorch-ref on --model is the reference."""
    if args.reference != "llamacpp" or args.reference_model:
        raise ParameterError("--subject compares a dump with llorch-ref on --model: --reference and "
                             "--reference-model do not apply")
    sub = load_dump(args.subject)
    decl = sub.arithmetic or {}
    chosen = {"numerics": args.numerics, "kv_dtype": args.kv_dtype,       # what the user set over the declaration
              "ggml_simd": None if args.ggml_simd == "auto" else args.ggml_simd}
    if decl and decl.get("reproducible") is False:
        args.numerics = args.numerics or decl["numerics"]
        args.kv_dtype = args.kv_dtype or decl["kv_dtype"]
        log(f"llorch-ref: the dump declares no reproducible arithmetic (llama.cpp's GPU backend, "
            f"{(decl.get('settings') or {}).get('n_gpu_layers', '?')} layers): the reference runs numerics "
            f"{args.numerics}, K/V {args.kv_dtype}, and the verdict is by the end-to-end bands")
    elif decl:
        args.numerics = args.numerics or decl["numerics"]
        args.kv_dtype = args.kv_dtype or decl["kv_dtype"]
        if args.numerics == "ggml" and args.ggml_simd == "auto" and decl.get("ggml_simd"):
            args.ggml_simd = decl["ggml_simd"]          # the build the dump came from, not the one installed here
        simd = f" ({args.ggml_simd} build)" if args.numerics == "ggml" else ""
        log(f"llorch-ref: the dump declares {decl['numerics']} arithmetic{simd_phrase(decl)}, K/V {decl['kv_dtype']}; "
             f"the reference runs numerics {args.numerics}{simd}, K/V {args.kv_dtype} (local errors are measured in "
             f"that arithmetic)")
    else:
        log("llorch-ref: the dump declares no arithmetic (format llorch-dump/1): local errors are measured in "
             "exact float32 unless --numerics/--kv-dtype say otherwise")
    eng = load_engine(args)
    # end to end, the weight class's bands (inherited error included); the declared arithmetic is held to
    # its own local bands, op by op
    overridden = any(v is not None and v != decl.get(k) for k, v in chosen.items())
    return eng, harness_run.run_subject(eng, sub, args.band_class, checkpoints=args.checkpoint,
                                        subject_label=f"{sub.engine} (dump {args.subject})", log=log,
                                        require=args.require, as_declared=not overridden)


def is_blackbox(subject) -> bool:
    """A black-box subject: openai:URL or mistralrs (anything else is a dump's path)."""
    return bool(subject) and (subject.startswith("openai:") or subject == "mistralrs")


def run_blackbox(args):
    """--subject openai:URL | mistralrs: the engine runs the prompt greedily, the reference (--model, in --numerics)
    runs teacher-forced on the prompt and the engine's tokens (harness/blackbox.py)."""
    if args.reference != "llamacpp" or args.reference_model or args.band_class:
        raise ParameterError("a black-box --subject is judged against llorch-ref on --model: --reference, "
                             "--reference-model and --band-class do not apply")
    if args.chat and args.subject == "mistralrs":
        raise ParameterError("--chat: for --subject openai:URL (mistral.rs runs the raw prompt)")
    if not args.prompt:
        raise ParameterError("empty prompt")
    eng = load_engine(args)
    if eng.tokenizer is None:
        raise ParameterError("this model has no vocabulary: a black box's tokens are named by it")
    steps = args.decode_steps
    if args.subject == "mistralrs":
        log(f"llorch-ref: running mistral.rs on {eng.path.name}, {steps} greedy steps ...")
        trace = mistralrs_trace(eng.path, args.prompt, eng.tokenizer, n_steps=steps, top_k=args.top_logprobs)
    else:
        url = args.subject[len("openai:"):]
        log(f"llorch-ref: asking {url} for {steps} greedy steps ...")
        trace = openai_trace(url, args.prompt, eng.tokenizer, n_steps=steps, top_k=args.top_logprobs or 20,
                             chat=args.chat, timeout=args.timeout)
    log(f"llorch-ref: running the reference teacher-forced on {len(trace.steps)} engine tokens ...")
    res = compare_trace(eng, trace, require=args.require)
    res.trace = trace                   # the subject's side a bundle keeps (prove)
    return eng, res


def run_transformers(args):
    """--reference transformers: llorch-ref on --model under test; transformers on --reference-model (a
    Hugging Face folder; default: --model, converted to one if it is a GGUF file) as the reference."""
    eng = load_engine(args)
    if eng.tokenizer is None:
        raise ParameterError("this model has no vocabulary: the transformers comparison needs a text prompt")
    if not args.prompt:
        raise ParameterError("empty prompt")
    ids = eng.tokenizer.encode(args.prompt)
    log("llorch-ref: running transformers (float32, eager) and the reference, capturing every checkpoint ...")
    ref = dump_transformers(args.reference_model or eng.path, prompt=args.prompt, token_ids=ids,
                            n_greedy=args.greedy)
    sub = record_engine(eng, ids, prompt=args.prompt, n_greedy=args.greedy)
    res = compare_dumps(sub, ref, eng.config, band_class_for(args, eng), checkpoints=args.checkpoint,
                        subject_label=engine_label(eng), reference_label=f"transformers {ref.version}",
                        model=str(eng.path), reference_model=str(ref.model_path))
    res.recipe = harness_run.recipe("transformers", ref.model_path, ids, prompt=args.prompt, n_greedy=args.greedy,
                                    checkpoints=args.checkpoint)
    return eng, res


def print_blackbox(res, file=None):
    """A black-box result's steps: KLD, the engine's token with its rank and logprobs on both sides, the reference's
    top-2 margin; then the first divergence with its position and both sides' top entries."""
    con = console_for(file)
    t = _table(f"{res.subject_label} step by step (teacher-forced reference)",
               ["step", "pos", "token", "KLD", "rank", "ref logprob", "engine logprob", "margin", "verdict"])
    for s in steps_table(res):
        add_row(t, str(s["step"]), str(s["position"]), repr(s["text"]), f"{s['kld']:.3g} ({s['kld_kind']})",
                str(s["rank"]), f"{s['ref_logprob']:.4f}", f"{s['engine_logprob']:.4f}", f"{s['margin']:.3f}",
                ("pass" if s["passed"] else "FAIL") + (" (near tie)" if s["near_tie"] and not s["same_top"] else ""))
    con.print(t)
    for line in divergence_lines(res):
        con.print(for_terminal(line))


def cmd_diff(args):
    eng, res = run_comparison(args)
    if args.json:
        out = res.to_json()
        print(json.dumps(out, indent=2))
    else:
        print_result(res, args.verbose)
        if is_blackbox(args.subject):
            print_blackbox(res)
        if args.by_position:
            print_by_position(res)
    return res.verdict().exit_code


def cmd_prove(args):
    t0 = time.perf_counter()
    out_dir, run_id = check_bundle_target(args.out, args.run_id)     # before the run, not after it
    key = load_signing_key(args.sign) if args.sign else None
    eng, res = run_comparison(args)
    paths = write_bundle(res, eng, out_dir=out_dir, run_id=run_id, argv=["llorch-ref"] + sys.argv[1:],
                         tensors=not args.no_tensors, plot=not args.no_plots, sign=key,
                         trace=getattr(res, "trace", None))
    print_result(res, False)
    if is_blackbox(args.subject):
        print_blackbox(res)
    print(f"proof bundle: {paths['dir']}/ (report.html, summary.md, junit.xml, manifest.json with every file's sha256"
          + (", repro/" if paths["repro"] else "") + ")")
    log(f"llorch-ref: prove took {time.perf_counter() - t0:.1f} s")
    return res.verdict().exit_code
