"""The comparisons a user runs, each two sources of tensors and one `compare_dumps`:

- run_diff: llorch-ref (any backend or numerics) against llama.cpp's capture on the same GGUF file;
- run_backend_diff: a backend (numba, cupy) against the NumPy oracle, on the prompt's forward and on one
  decode step after it (rows "@step1"), under the backend's band;
- run_subject: a dump under test (any engine) against llorch-ref, with local (teacher-forced) figures.
"""
from __future__ import annotations

import json
import time

import numpy as np

from ..backends import available, cpu_threads
from ..checkpoints import band_class_of, catalogue_path, coarser, engine_band_class, load_specs, on_gpu
from ..dump import Dump, catalogue, default_score_rows, expected_shape, load_dump, model_sha256
from ..errors import DumpError, HarnessError, PromptError
from ..loaders.gguf_file import open_reader
from ..loaders.lazy_weights import mem_available
from ..model.attention_chunks import CHUNK_ELEMENTS
from ..references.engines import dump_llamacpp
from ..references.llorch import engine_label, record_engine
from ..tensor_file import SpillStore
from .compare import compare_dumps, dims_of
from .result import DiffResult

DEFAULT_PROMPT = "Once upon a time, there was a little"


def _timed(res, key, fn, *a, **kw):
    t = time.perf_counter()
    out = fn(*a, **kw)
    res[key] = time.perf_counter() - t
    return out


def _greedy_texts(res, tokenizer):
    if res.greedy and tokenizer is not None:
        res.greedy["ours_text"] = tokenizer.decode(res.greedy["ours"])
        res.greedy["reference_text"] = tokenizer.decode(res.greedy["reference"])


def run_diff(engine, prompt=DEFAULT_PROMPT, reference_model=None, checkpoints=None, n_greedy=32,
             band_class=None, context=None, token_ids=None, rows=None, n_ubatch=512, n_batch=None, n_gpu_layers=0):
    """engine: llorch_ref Engine (the subject); reference_model: the GGUF llama.cpp runs (default: the
    engine's file); context: an open references.llamacpp.LlamaCpp to reuse (else one is made and closed).
    token_ids: instead of tokenizing the prompt; rows: the prompt rows both sides keep (default all);
    n_ubatch: llama.cpp's micro-batch (a longer prompt runs as several); n_batch: the most tokens one of its
    llama_decode calls takes (default llama.cpp's 2,048; the rows of logits its buffer holds); n_gpu_layers: the
    layers llama.cpp runs on its GPU backend (whose sums no numerics here reproduce: the weight class's bands)."""

    ref_path = str(reference_model or engine.path)
    if engine.tokenizer is None:
        raise HarnessError("this model has no vocabulary: the harness needs a text prompt")
    if not prompt and token_ids is None:
        raise PromptError("empty prompt")
    if engine.numerics == "exact" and engine.kv_dtype != "float32":
        raise HarnessError("the exact-numerics bands are measured with an F32 K/V cache; use --kv-dtype float32, "
                           "or --numerics ggml to compare against llama.cpp with a float16 cache")
    if band_class is None:
        band_class = "ggml" if engine.numerics == "ggml" and not n_gpu_layers else engine_band_class(engine)
        if reference_model is not None and band_class != "ggml":
            band_class = coarser(band_class, band_class_of({t.name: t.tensor_type.name
                                                            for t in open_reader(ref_path).tensors}))
        if n_gpu_layers:
            band_class = on_gpu(band_class)
    ids = engine.tokenizer.encode(prompt) if token_ids is None else list(token_ids)
    timings = {}
    t0 = time.perf_counter()
    score_rows = default_score_rows(rows if rows is not None else list(range(len(ids))), len(ids))
    spill = on_disk(engine.config, len(ids) if rows is None else len(rows))
    theirs = _timed(timings, "llamacpp_s", dump_llamacpp, ref_path, prompt=prompt, token_ids=ids, n_greedy=n_greedy,
                    kv_dtype=engine.kv_dtype, checkpoints=checkpoints, context=context, rows=rows,
                    n_ubatch=n_ubatch, store=SpillStore() if spill else None, score_rows=score_rows,
                    n_threads=reference_threads(engine), n_batch=n_batch, n_gpu_layers=n_gpu_layers)
    ours = _timed(timings, "ours_s", record_engine, engine, ids, prompt=prompt, n_greedy=n_greedy, rows=rows,
                  store=SpillStore() if spill else None, score_rows=score_rows)
    res = compare_dumps(ours, theirs, engine.config, band_class, checkpoints=checkpoints,
                        subject_label=engine_label(engine), reference_label="llama.cpp", model=str(engine.path),
                        reference_model=ref_path)
    _greedy_texts(res, engine.tokenizer)
    res.timings.update(timings, total_s=time.perf_counter() - t0)
    res.recipe = recipe("llamacpp", ref_path, ids, prompt=prompt, n_greedy=n_greedy, rows=rows, checkpoints=checkpoints,
                        kv_dtype=engine.kv_dtype, n_ubatch=n_ubatch,
                        **({} if n_batch is None else {"n_batch": n_batch}),
                        **({"n_gpu_layers": n_gpu_layers} if n_gpu_layers else {}))
    return res


def reference_threads(engine) -> int:
    """llama.cpp's threads in a diff: the subject's CPU threads (its --threads), on a GPU backend the cores this
    process may use (ggml's sums do not depend on the thread count: rows are split among threads, not sums)."""
    return int((getattr(engine.backend, "info", None) or {}).get("threads") or cpu_threads())


ON_DISK_BYTES = 512 * 2**20      # a dump whose per-token tensors take more goes to disk as it is recorded


def per_token_bytes(cfg, n_rows: int) -> int:
    """About the bytes of one dump's per-token tensors (float32, every layer) and logits at n_rows rows."""
    d, f, kv = cfg.d_model, cfg.d_ff, cfg.n_kv_heads * cfg.head_dim
    return 4 * n_rows * (cfg.n_layers * (10 * d + 4 * kv + 2 * f) + 2 * cfg.n_vocab)


def on_disk(cfg, n_rows: int) -> bool:
    """Whether a comparison's dumps are written to disk as they are recorded (tensor_file.SpillStore) and read
    back one tensor at a time: where they would take more than ON_DISK_BYTES in memory."""
    return per_token_bytes(cfg, n_rows) > ON_DISK_BYTES


def backend_band(engine) -> tuple[str, dict]:
    """-> (key, band) of this engine's backend and dtype in the catalogue's backend_bands.json."""
    key = engine.backend.name + ("" if engine.backend.dtype == "float32" else ":" + engine.backend.dtype)
    bands = json.loads((catalogue_path() / "backend_bands.json").read_text())["bands"]
    if key not in bands:
        raise HarnessError(f"no band for backend {key!r} in backend_bands.json (known: {', '.join(bands)})")
    return key, {k: v for k, v in bands[key].items() if not k.startswith("_")}


def backend_bands(band: dict):
    """-> bands(spec, pos) of a backend comparison: the backend's band on every tensor, exact agreement on the
    token checkpoints (argmax, greedy text)."""
    return lambda spec, pos: {"agreement": 1.0} if spec.chosen_tokens else band


def run_backend_diff(engine, reference, prompt=DEFAULT_PROMPT, checkpoints=None, n_greedy=32, band=None):
    """Every checkpoint of `engine` (numba, cupy, ...) against `reference` (the numpy oracle), on the same
    file and tokens, under one band per backend and dtype (token checkpoints: exact agreement). The layer
    checkpoints are compared on the prompt's forward and on one decode step after it (the last prompt token
    fed again; rows '<tensor>@step1'), since a backend may run other kernels for one token than for several
    (numba does)."""
    key, default = backend_band(engine)
    band = band or default
    ids = engine.tokenizer.encode(prompt) if engine.tokenizer else list(range(1, 10))
    specs = [s.id for s in load_specs(checkpoints) if s.id != "0"]      # same tokenizer object: nothing to compare
    bands = backend_bands(band)
    t0 = time.perf_counter()
    ours, theirs = (record_engine(e, ids, n_greedy=n_greedy, decode_ids=ids[-1:]) for e in (engine, reference))
    res = compare_dumps(ours, theirs, engine.config, f"backend:{key}", checkpoints=specs, bands=bands,
                        subject_label=engine_label(engine), reference_label=engine_label(reference),
                        model=str(engine.path), reference_model=str(reference.path))
    _greedy_texts(res, engine.tokenizer)
    res.timings["total_s"] = time.perf_counter() - t0
    res.recipe = recipe("llorch", engine.path, ids, n_greedy=n_greedy, checkpoints=specs, backend="numpy",
                        numerics="exact", kv_dtype="float32", decode_ids=ids[-1:], backend_band=band)
    return res


def check_dump(dump, model=None, require="auto", band_class=None, checkpoints=None, backend=None,
               log=None) -> DiffResult:
    """The Python face of `llorch-ref diff --subject DUMP --model MODEL`: the dump (a path or a Dump) against
    llorch-ref on `model` (default: the default model) in the arithmetic the dump declares. -> the DiffResult;
    its .verdict() is the verdict the CLI prints and exits by, for the same file and options."""
    import llorch_ref

    sub = dump if isinstance(dump, Dump) else load_dump(dump)
    engine = declared_engine(llorch_ref.load(model, backend=backend), sub)
    return run_subject(engine, sub, band_class, checkpoints=checkpoints, require=require, log=log,
                       subject_label=f"{sub.engine} (dump {sub.source})")


def declared_engine(engine, sub: Dump):
    """The reference engine in the arithmetic the dump declares (numerics, K/V cache type, the ggml build):
    `engine` itself where it already runs it, else the same file loaded that way on declared_backend's backend. A
    dump that declares nothing (format llorch-dump/1) keeps the engine as it is."""
    import llorch_ref

    decl = sub.arithmetic
    if not decl:
        return engine
    simd = decl.get("ggml_simd") or "auto"
    same = (engine.numerics == decl["numerics"] and engine.kv_dtype == decl["kv_dtype"]
            and (decl["numerics"] != "ggml" or simd == "auto" or engine.ggml_simd == simd))
    if same:
        return engine
    return llorch_ref.load(engine.path, backend=declared_backend(engine, decl["numerics"]),
                           threads=engine.backend.info.get("threads"), numerics=decl["numerics"],
                           kv_dtype=decl["kv_dtype"], ggml_simd=simd if decl["numerics"] == "ggml" else "auto")


def declared_backend(engine, numerics: str) -> str:
    """The backend that runs a declared arithmetic: numba for numerics "ggml" asked of a numpy engine where numba is
    installed (its ggml kernels compute the NumPy emulation's bits: tests/test_ggml_numerics.py), else the
    engine's own."""
    if numerics == "ggml" and engine.backend.name == "numpy" and available(("numba",))["numba"] is None:
        return "numba"
    return engine.backend.name


def run_subject(engine, sub: Dump, band_class: str | None = None, checkpoints=None, subject_label=None,
                n_greedy=None, log=None, require="auto", as_declared=True) -> DiffResult:
    """A dump under test against llorch-ref on `engine` (the reference), on the dump's token ids; the greedy
    continuation as long as the subject's (or n_greedy). Shared by `diff --subject`, check_dump and the pytest
    plugin, so one file gets one verdict. as_declared: the reference runs the dump's declared arithmetic
    (declared_engine); False keeps `engine` as it is (the CLI's explicit --numerics/--kv-dtype). band_class:
    default from the engine's weight types. require: what the verdict requires covered (harness/verdict.py)."""
    if as_declared:
        engine = declared_engine(engine, sub)
    band_class = band_class or dump_band_class(engine, sub)
    check_dump_fits(sub, engine.config)
    keep = held_keys(sub)
    check_memory(sub, engine, keep)                   # before anything runs
    warn = check_same_model(sub, engine)
    n = n_greedy or (len(sub.raw("12", "greedy_tokens")) if sub.has("12", "greedy_tokens") else 0)
    if log:
        log(f"llorch-ref: running the reference on the dump's {len(sub.token_ids)} tokens"
            + (f", its {len(sub.decode_token_ids)} decode steps" if sub.decode_token_ids else "")
            + (f" and {n} greedy tokens" if n else "") + " ...")
    ref = record_engine(engine, sub.token_ids, prompt=sub.manifest.get("prompt"), n_greedy=n,
                        decode_ids=sub.decode_token_ids or None,      # teacher-forced: the subject's tokens
                        rows=sub.manifest.get("rows"), keep=keep,      # and the rows and tensors it holds
                        store=SpillStore() if on_disk(engine.config, len(sub.rows)) else None,
                        score_rows=sub.manifest.get("score_rows"))
    res = compare_dumps(sub, ref, engine.config, band_class, checkpoints=checkpoints,
                        subject_label=subject_label or sub.engine, reference_label=engine_label(engine),
                        model=sub.source, reference_model=str(engine.path),
                        local_engine=engine if reproducible(sub) else None)
    if warn:
        res.warnings.append(warn)
    res.require = require
    res.not_applicable = [] if engine.tokenizer is not None else ["cp0"]      # no vocabulary: nothing to tokenize
    res.recipe = recipe("llorch", engine.path, sub.token_ids, prompt=sub.manifest.get("prompt"), n_greedy=n,
                        rows=sub.manifest.get("rows"), checkpoints=checkpoints, backend=engine.backend.name,
                        numerics=engine.numerics, kv_dtype=engine.kv_dtype, ggml_simd=engine.ggml_simd,
                        decode_ids=sub.decode_token_ids or None, local=True, require=require)
    return res


def dump_band_class(engine, sub: Dump) -> str:
    """The bands a dump is judged by: the reference's weight class, measured on llama.cpp's GPU backend where the
    dump declares layers run there (settings.n_gpu_layers > 0, no reproducible arithmetic)."""
    settings = (sub.arithmetic or {}).get("settings")
    layers = settings.get("n_gpu_layers") if isinstance(settings, dict) else None      # a third party's file
    gpu = not reproducible(sub) and isinstance(layers, int) and layers > 0
    bc = engine_band_class(engine)
    return on_gpu(bc) if gpu else bc


def reproducible(sub: Dump) -> bool:
    """Whether the dump's declared arithmetic is one a local comparison reproduces (not so for llama.cpp's GPU
    backend: "reproducible": false, judged by the end-to-end bands alone)."""
    return (sub.arithmetic or {}).get("reproducible", True) is not False


def recipe(kind: str, model, token_ids, **settings) -> dict:
    """How to run the reference side of a comparison again from nothing but this dict (a bundle's manifest
    keeps it; `llorch-ref verify` runs it): the engine kind (llamacpp | llorch | transformers), its model file
    and sha256, the token ids and every setting the reference ran with."""
    return {"kind": kind, "model": str(model), "model_sha256": model_sha256(model),
            "token_ids": [int(t) for t in token_ids], **settings}


def check_same_model(sub: Dump, engine) -> str | None:
    """-> a warning line when the subject ran another file than the reference model (or None)."""
    theirs = sub.manifest["model"].get("sha256", "unknown")
    ours = model_sha256(engine.path)
    if theirs == "unknown":
        return f"the subject's manifest gives no model sha256: cannot check it ran {engine.path}"
    if theirs != ours:
        return (f"the subject ran model sha256 {theirs[:12]}… ({sub.manifest['model'].get('path', '')}); the "
                f"reference runs {engine.path} (sha256 {ours[:12]}…): different files (a conversion?)")
    return None


def held_keys(sub: Dump) -> set:
    """The (checkpoint, tensor) pairs the reference records for this subject: what the subject holds (prompt and
    decode steps), the tokenization and greedy tokens, and the logits where the subject's argmax or probabilities
    are derived from them."""
    keys = {(cp, t) for (cp, t, _) in sub.index} | {("0", "token_ids"), ("12", "greedy_tokens")}
    for k in sub.steps:
        keys |= {(cp, t) for (cp, t, _) in sub.step_view(k).index}
    if keys & {("8", "logits"), ("10", "argmax"), ("11", "probs")}:
        keys.add(("8", "logits"))
    return keys


def comparison_bytes(sub: Dump, cfg, keep: set) -> int:
    """About the memory a comparison of this dump takes at its peak: each kept tensor twice (both sides, float32,
    as canonical arrays) for the prompt's forward and each decode step, the reference forward's attention
    scores and probabilities of one layer (float32 H x T x S, a few copies), its K/V cache and its logits."""

    t, n_rows = len(sub.token_ids), len(sub.rows)
    steps = len(sub.decode_token_ids)
    cat, total = catalogue(), 0
    # a long dump's tensors go to disk as they are recorded and are compared one layer at a time
    per_layer = 1 if on_disk(cfg, n_rows) else cfg.n_layers
    for d, layers in ((dims_of(cfg, t, n_rows=n_rows), 1), (dims_of(cfg, 1, past=t + steps), steps)):
        for (cp, name) in keep:
            e = cat.get((cp, name))
            if e is None or not layers:
                continue
            shape = expected_shape(e, d) or [1]             # a shape over unknown sizes (N tokens): small
            per = int(np.prod(shape, dtype=np.int64)) * (per_layer if e["scope"] == "layer" else 1)
            total += 2 * 4 * per * layers
    s = t + steps
    total += 4 * 4 * min(cfg.n_heads * t * s, CHUNK_ELEMENTS)      # one chunk's scores, probabilities, temporaries
    total += 2 * 4 * cfg.n_layers * s * cfg.n_kv_heads * cfg.head_dim + 3 * 4 * t * cfg.n_vocab
    return int(total)


def check_memory(sub: Dump, engine, keep: set):
    """Refuse a dump whose comparison would not fit in memory, before anything runs: the token count inside the
    model's context, the estimate (comparison_bytes) inside 80% of the memory available now."""

    cfg = engine.config
    fed = len(sub.token_ids) + len(sub.decode_token_ids)
    n_ctx = engine.n_ctx
    if fed > n_ctx:
        raise DumpError(f"{sub.source}: {len(sub.token_ids)} prompt and {len(sub.decode_token_ids)} decode tokens "
                        f"exceed the reference's context of {n_ctx} (load it with a longer --ctx, up to the model's "
                        f"{cfg.context_length})")
    need, have = comparison_bytes(sub, cfg, keep), int(0.8 * mem_available())
    if need > have:
        raise DumpError(f"{sub.source}: comparing this dump needs about {need / 2**30:.1f} GiB ({len(sub.token_ids)} "
                        f"tokens, {len(sub.rows)} rows held, {len(keep)} tensor kinds), over the {have / 2**30:.1f} GiB "
                        f"(80% of the memory available) it may take: hold fewer rows (dump --rows) or fewer tokens")


def check_dump_fits(sub: Dump, cfg):
    """Layer indices inside the model (the shapes are checked per tensor)."""
    for (cp, t, layer) in sub.index:
        if layer is not None and layer >= cfg.n_layers:
            raise DumpError(f"{sub.source}: tensor {sub.index[(cp, t, layer)]} names layer {layer}, but the model "
                            f"has {cfg.n_layers} layers (0..{cfg.n_layers - 1})")
    fed = sub.token_ids + sub.decode_token_ids
    if max(fed) >= cfg.n_vocab:
        raise DumpError(f"{sub.source}: token id {max(fed)} in the manifest is outside the model's "
                        f"vocabulary of {cfg.n_vocab}")
    for k in sub.steps:
        check_dump_fits(sub.step_view(k), cfg)
