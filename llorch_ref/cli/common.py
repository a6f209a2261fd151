"""What every command shares: logging to stderr, loading the engine the options describe, the checks made
before anything is loaded, the API token."""
from __future__ import annotations

import os
import sys
import time

import llorch_ref

from ..backends import BACKENDS, available, backend_name
from ..errors import ParameterError
from ..generate.sampling import SamplingParams
from ..harness.text_safety import for_terminal
from ..loaders.text_file import read_text_file


def log(msg):
    """One line on stderr, every character a terminal would act on escaped (names in it come from files)."""
    print(for_terminal(msg), file=sys.stderr, flush=True)


def load_engine(args):
    t0 = time.perf_counter()
    eng = llorch_ref.load(args.model, backend=getattr(args, "backend", None), dtype=args.dtype,
                          n_ctx=getattr(args, "ctx", None), numerics=args.numerics or "exact",
                          kv_dtype=args.kv_dtype or "float32", ggml_simd=getattr(args, "ggml_simd", "auto"),
                          weights=args.weights, weight_cache_mb=args.weight_cache_mb, weight_dtype=args.weight_dtype,
                          threads=getattr(args, "threads", None))
    wi = eng.weights_info()
    how = (f"lazy weights ({wi['dequantized_mb']:.0f} MB dequantized as {wi['storage']}, cache "
           f"{wi['budget_mb']:.0f} MB)" if wi["lazy"] else f"weights dequantized at load ({wi['storage']})")
    if "kernel_blocks_mb" in wi:
        how += f", kernel blocks {wi['kernel_blocks_mb']:.0f} MB"
    log(f"llorch-ref: loaded {eng.path.name} ({eng.config.arch}, {eng.config.n_layers} layers) "
         f"in {time.perf_counter() - t0:.2f} s, backend {eng.backend.name}, numerics {eng.numerics}"
         f"{f' ({eng.ggml_simd} build)' if eng.ggml_simd else ''}, "
         f"K/V cache {eng.kv_dtype}, {how}")
    if eng.backend.name == "numba" and eng.numerics == "exact" and not eng.backend.info.get("kernel_matrices"):
        log("llorch-ref: note: no matrix of this model has a numba kernel (kernels: "
            f"{', '.join(eng.backend.info['kernel_types'])} GGUF blocks); every product goes to BLAS, as on "
            "--backend numpy")
    if eng.backend.info.get("kernels_compiled"):
        log(f"llorch-ref: note: numba compiled {eng.backend.info['kernels_compiled']} kernels for this CPU while "
            "loading (its cache was empty or stale: a first run, or the first after an upgrade); the first request "
            "compiles the rest before its first tokens (the default model: about 11 s on a 2-core AMD EPYC); later "
            "runs load them from the cache")
    return eng


def sampling_kwargs(args) -> dict:
    return dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
                frequency_penalty=args.frequency_penalty, penalty_last_n=args.penalty_last_n, seed=args.seed)


def preflight(args):
    """What can be checked before a model is loaded or a comparison runs, so a bad value costs nothing."""
    backend = backend_name(getattr(args, "backend", None))
    if backend != "numpy":
        reason = available((backend,)).get(backend, f"not one of {', '.join(BACKENDS)}")
        if reason:
            raise ParameterError(f"--backend {backend}: {reason}")
    if hasattr(args, "temperature"):
        errs = SamplingParams(**sampling_kwargs(args)).errors()
        if errs:
            raise ParameterError("; ".join(f"--{k.replace('_', '-')}: {v}" for k, v in errs.items()))
        if args.max_tokens < 0:
            raise ParameterError(f"--max-tokens must be >= 0, got {args.max_tokens}")
    if getattr(args, "ctx", None) is not None and args.ctx < 1:
        raise ParameterError(f"--ctx must be >= 1, got {args.ctx}")
    read_prompt(args)
    if args.cmd == "generate" and not args.prompt.strip():
        raise ParameterError("empty prompt (or only whitespace): give some text to continue")


def read_prompt(args):
    """--prompt-file: the prompt read from a UTF-8 file (not with --prompt); else --prompt, or the default."""
    f = getattr(args, "prompt_file", None)
    if f is None:
        return
    if args.prompt is not None:
        raise ParameterError("give --prompt or --prompt-file, not both")
    if getattr(args, "token_ids", None):
        raise ParameterError("give --token-ids or --prompt-file, not both")
    args.prompt = read_text_file(f, "--prompt-file")


def api_token(args) -> str | None:
    """--api-token-file, then $LLORCH_API_TOKEN, then --api-token (visible in ps); an empty token is an error,
    never auth turned off."""
    given = [(n, v) for n, v in (("--api-token", args.api_token), ("--api-token-file", args.api_token_file))
             if v is not None]
    if len(given) > 1:
        raise ParameterError("give --api-token or --api-token-file, not both")
    if args.api_token_file is not None:
        token = read_text_file(args.api_token_file, "--api-token-file", limit=4096, blank_ok=True).strip()
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
