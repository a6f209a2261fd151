"""One comparison run: our forward (recorded) against llama.cpp (captured), checkpoint by checkpoint.

Our side runs a warm-up sequence through the same cache first and resets it, so a cache that leaks
state between sequences shows up as a divergence. Layer checkpoints run on every layer.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from ..errors import HarnessError, PromptError
from .metrics import compare, within
from .specs import band_class_of, coarser, engine_band_class, greedy_band, load_specs

DEFAULT_PROMPT = "Once upon a time, there was a little"
WARMUP_PROMPT = "The quick brown fox jumps over the lazy dog, again and again and again."


# layout name -> fn(llama.cpp array in NumPy order, our array) -> array shaped like ours (or not, if wrong)
LAYOUTS = {
    "same": lambda a, o: a.reshape(o.shape) if a.size == o.size else a,
    "kq": lambda a, o: a[..., : o.shape[-1]],                                # (H, T, n_kv) -> [H, T, S]
    "k_cache": lambda a, o: a[: o.shape[0]],                                # (n_kv, KV, Hd) -> [S, KV, Hd]
    "v_cache": lambda a, o: a.transpose(2, 1, 0)[: o.shape[0]],             # (Hd, KV, n_kv) -> [S, KV, Hd]
}


@dataclass
class Row:
    checkpoint: str
    name: str
    layer: int | None
    tensor: str
    metrics: dict
    band: dict
    passed: bool
    order: tuple
    local: dict | None = None          # teacher-forced: the reference op on the subject's inputs vs its output
    local_band: dict | None = None
    local_passed: bool | None = None

    @property
    def diverges(self) -> bool:
        """Where a local figure exists, it decides (the end-to-end error may be inherited); else the
        end-to-end one."""
        return not (self.local_passed if self.local_passed is not None else self.passed)


@dataclass
class DiffResult:
    model: str
    reference_model: str
    prompt: str
    token_ids: list
    band_class: str
    rows: list = field(default_factory=list)
    captures_ours: dict = field(default_factory=dict)
    captures_ref: dict = field(default_factory=dict)
    llamacpp_settings: dict = field(default_factory=dict)
    greedy: dict = field(default_factory=dict)
    timings: dict = field(default_factory=dict)
    specs: list = field(default_factory=list)
    subject_label: str = "llorch-ref"
    reference_label: str = "llama.cpp"
    capture_files: tuple = ("ours.npz", "llamacpp.npz")
    not_covered: list = field(default_factory=list)      # [{checkpoint, name, layer, tensor, why}]
    warnings: list = field(default_factory=list)         # lines a reader must see (e.g. different model files)
    local_declaration: str | None = None                 # the arithmetic of the local comparison, when one ran

    @property
    def first_divergence(self):
        """The first row in forward order that diverges: by its local (teacher-forced) error where the
        comparison has one, else by its end-to-end error."""
        bad = [r for r in self.rows if r.diverges]
        if not bad:
            return None
        r = min(bad, key=lambda r: r.order)
        return {"checkpoint": r.checkpoint, "layer": r.layer, "tensor": r.tensor,
                "by": "local error" if r.local_passed is not None else "end-to-end error"}

    def passed(self, checkpoint=None) -> bool:
        """No row diverges (by local error where measured, else end to end)."""
        return not any(r.diverges for r in self.rows if checkpoint is None or r.checkpoint == checkpoint)

    def summary(self) -> list[dict]:
        """One line per checkpoint: worst figures over its tensors and layers."""
        out = []
        for spec in self.specs:
            rows = [r for r in self.rows if r.checkpoint == spec.id]
            missing = [u for u in self.not_covered if u["checkpoint"] == spec.id]
            if not rows:
                if missing:
                    out.append({"checkpoint": spec.id, "name": spec.name, "rows": 0, "failed": 0,
                                "not_covered": len(missing), "why": missing[0]["why"], "worst_nmse": None,
                                "worst_max_abs": None, "min_cosine": None, "min_agreement": None,
                                "equal_prefix": None, "worst_at": {"layer": None, "tensor": "-"},
                                "band": spec.band(self.band_class), "passed": None})
                continue
            worst = max(rows, key=lambda r: (not r.passed, r.metrics.get("nmse", 0.0)))
            # token checkpoints have agreement figures instead of tensor metrics
            out.append({
                "checkpoint": spec.id, "name": spec.name, "rows": len(rows),
                "failed": sum(not r.passed for r in rows),
                "worst_nmse": max((r.metrics["nmse"] for r in rows if "nmse" in r.metrics), default=None),
                "worst_max_abs": max((r.metrics["max_abs"] for r in rows if "max_abs" in r.metrics), default=None),
                "min_cosine": min((r.metrics["cosine"] for r in rows if "cosine" in r.metrics), default=None),
                "min_agreement": min((r.metrics["agreement"] for r in rows if "agreement" in r.metrics),
                                     default=None),
                "equal_prefix": min((r.metrics["equal_prefix"] for r in rows if "equal_prefix" in r.metrics),
                                    default=None),
                "worst_at": {"layer": worst.layer, "tensor": worst.tensor},
                "band": worst.band, "passed": all(r.passed for r in rows),     # the band at the worst row
                "not_covered": len(missing), "why": missing[0]["why"] if missing else None,
            })
        return out

    def to_json(self) -> dict:
        return {
            "model": self.model, "reference_model": self.reference_model, "prompt": self.prompt,
            "token_ids": self.token_ids, "band_class": self.band_class,
            "first_divergence": self.first_divergence, "passed": self.passed(),
            "summary": self.summary(), "greedy": self.greedy, "timings": self.timings,
            "llamacpp_settings": self.llamacpp_settings, "subject": self.subject_label,
            "reference": self.reference_label, "not_covered": self.not_covered, "warnings": self.warnings,
            "local_declaration": self.local_declaration,
            "rows": [{"checkpoint": r.checkpoint, "name": r.name, "layer": r.layer, "tensor": r.tensor,
                      **r.metrics, "band": r.band, "passed": r.passed,
                      **({"local": r.local, "local_band": r.local_band, "local_passed": r.local_passed}
                         if r.local is not None else {})} for r in self.rows],
        }


def _llama_names(specs, n_layers, cfg=None):
    """Exact llama.cpp node names the specs need, for every layer."""
    names = set()
    for s in specs:
        for t in s.tensors_for(cfg):
            lc = t.node(cfg) if cfg is not None else t.llamacpp
            if lc is not None:
                names |= {lc["name"].replace("{L}", str(i)) for i in range(n_layers)}
    return names


def run_diff(engine, prompt=DEFAULT_PROMPT, reference_model=None, checkpoints=None, n_greedy=32,
             band_class=None, ref=None) -> DiffResult:
    """engine: llorch_ref Engine; reference_model: the GGUF llama.cpp runs (default: the engine's file)."""
    from ..references.llamacpp import Capture, LlamaCpp, tokenize

    specs = load_specs(checkpoints)
    cfg = engine.config
    ref_path = str(reference_model or engine.path)
    if engine.tokenizer is None:
        raise HarnessError("this model has no vocabulary: the harness needs a text prompt")
    if not prompt:
        raise PromptError("empty prompt")
    ids = engine.tokenizer.encode(prompt)
    if engine.numerics == "exact" and engine.kv_dtype != "f32":
        raise HarnessError("the exact-numerics bands are measured with an F32 K/V cache; use --kv-dtype f32, "
                           "or --numerics ggml to compare against llama.cpp with an f16 cache")
    if band_class is None and engine.numerics == "ggml":
        band_class = "ggml"
    if band_class is None:
        band_class = engine_band_class(engine)
        if reference_model is not None:
            from ..loaders.gguf_file import open_reader
            r = open_reader(ref_path)
            band_class = coarser(band_class, band_class_of({t.name: t.tensor_type.name for t in r.tensors}))
    res = DiffResult(model=str(engine.path), reference_model=ref_path, prompt=prompt, token_ids=ids,
                     band_class=band_class, specs=specs)
    n_ctx = max(256, 64 * ((len(ids) + n_greedy + 63) // 64))
    t0 = time.perf_counter()
    own_ref = ref is None
    if not own_ref and ref.settings["type_k"] != engine.kv_dtype:
        raise HarnessError(f"the llama.cpp context given has a {ref.settings['type_k']} K/V cache; the engine "
                           f"uses {engine.kv_dtype}")
    if not own_ref and ref.n_ctx < len(ids) + n_greedy:
        raise HarnessError(f"the llama.cpp context given holds {ref.n_ctx} positions; this run needs "
                           f"{len(ids) + n_greedy}")
    if own_ref:
        ref = LlamaCpp(ref_path, n_ctx=n_ctx, kv_type=engine.kv_dtype)
    res.llamacpp_settings = ref.settings
    try:
        by_id = {s.id: s for s in specs}
        # -- 0: tokenizer --------------------------------------------------------------------------
        if "0" in by_id:
            ref_ids = tokenize(ref_path, prompt)
            agree = ref_ids == ids
            m = {"shape": [len(ids)], "ref_shape": [len(ref_ids)], "agreement": 1.0 if agree else 0.0,
                 "ours": ids, "reference": ref_ids}
            res.rows.append(Row("0", by_id["0"].name, None, "token_ids", m, by_id["0"].band(band_class),
                                within(m, by_id["0"].band(band_class)), (0, 0, 0)))
        # -- llama.cpp forward with capture --------------------------------------------------------
        cap = Capture(names=_llama_names(specs, cfg.n_layers, cfg) | {"result_output"})
        t1 = time.perf_counter()
        ref_logits = ref.eval(ids, cap)
        res.timings["llamacpp_eval_s"] = time.perf_counter() - t1
        ref_last = ref.eval_last(ids)          # as generation asks for it: one output row
        if not cap.checked and any(s.scope == "layer" for s in specs):
            raise HarnessError("llama.cpp's eval callback captured nothing: is the capture wired?")
        # -- our forward, after a warm-up sequence through the same cache --------------------------
        rec = {}

        def record(name, layer, arr):
            rec[(name, layer)] = np.array(engine.backend.to_numpy(arr), dtype=np.float32, copy=True)

        cache = engine.new_cache()
        warm = engine.tokenizer.encode(WARMUP_PROMPT)
        engine.forward(warm, cache, rows=[len(warm) - 1])
        cache.reset()
        t1 = time.perf_counter()
        ours_logits = engine.backend.to_numpy(engine.forward(ids, cache, record=record))
        res.timings["ours_forward_s"] = time.perf_counter() - t1
        # the last row alone, as generation asks for it (rows=[T-1]) on a fresh cache
        ours_last = engine.backend.to_numpy(engine.forward(ids, engine.new_cache(), rows=[len(ids) - 1]))[-1]
        # -- layer and model tensors ---------------------------------------------------------------
        # a llama.cpp node computed at reduced precision (spec field "band_class" on its node) makes the bands
        # of that class apply from that node on, in forward order (Gemma 3: GELU read from a float16 table)
        band_at, why = band_schedule(specs, cfg, band_class)
        if why:
            res.warnings.append(why)

        for s in specs:
            if s.scope == "layer":
                for layer in range(cfg.n_layers):
                    for t in s.tensors_for(cfg):
                        _compare_tensor(res, s, t, layer, rec, cap, band_at(s, (1, layer, t.order)), cfg)
            elif s.scope == "model":
                num = int("".join(c for c in s.id if c.isdigit()) or 0)
                _model_checkpoint(res, s, band_at(s, (2, 0, num - 0.5)), ours_logits, ours_last, ref_logits,
                                  ref_last, rec, cap)
        # -- 12: end-to-end greedy text ------------------------------------------------------------
        if "12" in by_id and n_greedy > 0:
            s = by_id["12"]
            t1 = time.perf_counter()
            ours_gen = list(engine.generate_ids(ids, max_tokens=n_greedy, ignore_eos=True))
            t2 = time.perf_counter()
            ref_gen = ref.greedy(ids, n_greedy)
            res.timings["ours_greedy_s"] = t2 - t1
            res.timings["llamacpp_greedy_s"] = time.perf_counter() - t2
            n_same = next((i for i, (a, b) in enumerate(zip(ours_gen, ref_gen)) if a != b),
                          min(len(ours_gen), len(ref_gen)))
            m = {"shape": [len(ours_gen)], "ref_shape": [len(ref_gen)], "agreement": n_same / max(n_greedy, 1),
                 "equal_prefix": n_same, "n": n_greedy}
            res.greedy = {"n": n_greedy, "equal_prefix": n_same, "ours": ours_gen, "reference": ref_gen,
                          "ours_text": engine.tokenizer.decode(ours_gen),
                          "reference_text": engine.tokenizer.decode(ref_gen)}
            gb = greedy_band(by_id["12"].band(band_class), n_greedy)
            res.rows.append(Row("12", by_id["12"].name, None, "greedy_tokens", m, gb, within(m, gb), (3, 99, 0)))
    finally:
        if own_ref:
            ref.close()
    res.captures_ours = {f"{n}.layer{l}" if l is not None else n: a for (n, l), a in rec.items()}
    res.captures_ref = {f"{n}#{op}#{occ}": a for (n, op, occ), a in cap.tensors.items()}
    res.timings["total_s"] = time.perf_counter() - t0
    return res


def band_schedule(specs, cfg, band_class, llamacpp: bool = True):
    """-> (band_at(spec, pos), warning or None): the band of a comparison at forward position pos; where one
    side is llama.cpp, the class is made coarser from a reduced-precision llama.cpp node on
    (reduced_precision_from)."""
    floor = reduced_precision_from(specs, cfg, band_class) if llamacpp else None

    def band_at(spec, pos):
        return spec.band(coarser(band_class, floor["class"]) if floor and pos >= floor["pos"] else band_class)
    return band_at, (floor["why"] if floor else None)


def reduced_precision_from(specs, cfg, band_class) -> dict | None:
    """The first (forward order) llama.cpp node of this model that declares a coarser band class
    (node field "band_class", with "why"): {"pos", "class", "why"}, or None. Not for numerics="ggml"."""
    if band_class == "ggml":
        return None
    found = []
    for s in specs:
        for t in s.tensors_for(cfg):
            lc = t.node(cfg) or {}
            if lc.get("band_class") and s.scope == "layer":
                found.append(((1, 0, t.order), lc["band_class"], s, t, lc))
    if not found:
        return None
    pos, cls, s, t, lc = min(found, key=lambda f: f[0])
    if coarser(band_class, cls) == band_class:
        return None
    return {"pos": pos, "class": cls,
            "why": f"bands of class {cls} from checkpoint {s.id} layer 0 {t.ours} on: {lc.get('why', 'llama.cpp computes this node at reduced precision')}"}


def _compare_tensor(res, spec, t, layer, rec, cap, band, cfg):
    key_ours = (t.ours, layer)
    lc = t.node(cfg)
    if key_ours not in rec:
        raise HarnessError(f"checkpoint {spec.id}: our forward recorded no {t.ours!r} for layer {layer}")
    if lc is None:
        res.not_covered.append({"checkpoint": spec.id, "name": spec.name, "layer": layer, "tensor": t.ours,
                                "why": f"llama.cpp's {cfg.arch} graph does not name this node ({t.llamacpp['name']})"})
        return
    key_ref = (lc["name"].replace("{L}", str(layer)), lc["op"], int(lc.get("occurrence", 0)))
    if key_ref not in cap.tensors:
        raise HarnessError(f"checkpoint {spec.id}: llama.cpp produced no node {key_ref} (this llama.cpp build "
                           f"names its graph differently; captured {len(cap.tensors)} nodes)")
    ours = rec[key_ours]
    theirs = LAYOUTS[t.layout](t.from_llamacpp(cfg, cap.tensors[key_ref]), ours)
    m = compare(ours, theirs)
    res.rows.append(Row(spec.id, spec.name, layer, t.ours, m, band, within(m, band), (1, layer, t.order)))


def _softmax64(x):
    """Independent float64 softmax of the reference's logits (not the function under test)."""
    x = np.asarray(x, dtype=np.float64)
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _model_checkpoint(res, spec, band, ours_logits, ours_last, ref_logits, ref_last, rec, cap):
    from ..generate import sampling

    order = (2, 0, int("".join(c for c in spec.id if c.isdigit()) or 0))
    if spec.name == "logits":
        m = compare(ours_logits, ref_logits)
        res.rows.append(Row(spec.id, spec.name, None, "result_output", m, band, within(m, band), order))
        for t in spec.tensors:            # final norm too
            ours = rec[(t.ours, None)]
            key = (t.llamacpp["name"], t.llamacpp["op"], int(t.llamacpp.get("occurrence", 0)))
            m = compare(ours, LAYOUTS[t.layout](cap.tensors[key], ours))
            res.rows.append(Row(spec.id, spec.name, None, t.ours, m, band, within(m, band),
                                (2, 0, int(spec.id) - 0.5)))
    elif spec.name == "last_token_logits":
        m = compare(ours_last, ref_last)
        res.rows.append(Row(spec.id, spec.name, None, "result_output[-1]", m, band, within(m, band), order))
    elif spec.name == "greedy_argmax":
        a = np.array([sampling.greedy(row) for row in ours_logits])      # the pick generation uses
        b = ref_logits.argmax(-1)
        m = {"shape": list(a.shape), "agreement": float((a == b).mean()), "ours": a.tolist(),
             "reference": b.tolist()}
        res.rows.append(Row(spec.id, spec.name, None, "argmax", m, band, within(m, band), order))
    elif spec.name == "softmax_probs":
        m = compare(sampling.softmax(ours_logits), _softmax64(ref_logits))
        res.rows.append(Row(spec.id, spec.name, None, "softmax(logits)", m, band, within(m, band), order))
    elif spec.name == "greedy_text":
        pass                                   # handled by run_diff (needs generation on both sides)
    else:
        raise HarnessError(f"{spec.path}: unknown model-scope checkpoint name {spec.name!r}")


def run_backend_diff(engine, reference, prompt=DEFAULT_PROMPT, checkpoints=None, n_greedy=32,
                     band=None) -> DiffResult:
    """Every checkpoint of `engine` (numba, cupy, ...) against `reference` (the numpy oracle), on the same
    file and tokens. Bands: checkpoints/backend_bands.json, per backend and dtype.

    The layer checkpoints are compared twice: on the prompt's forward (T tokens at once), and on one
    decode step after it (the last prompt token fed again at position T; tensor names end in "@step"),
    since a backend may run other kernels for one token than for several (numba does)."""
    import json

    from .specs import _spec_dir

    specs = [s for s in load_specs(checkpoints) if s.id != "0"]          # same tokenizer object: nothing to compare
    cfg = engine.config
    key = engine.backend.name + ("" if engine.backend.dtype == "float32" else ":" + engine.backend.dtype)
    if band is None:
        bands = json.loads((_spec_dir() / "backend_bands.json").read_text())["bands"]
        if key not in bands:
            raise HarnessError(f"no band for backend {key!r} in backend_bands.json (known: {', '.join(bands)})")
        band = {k: v for k, v in bands[key].items() if not k.startswith("_")}
    ids = engine.tokenizer.encode(prompt) if engine.tokenizer else list(range(1, 10))
    res = DiffResult(model=str(engine.path), reference_model=f"llorch-ref {reference.backend.name} "
                     f"({reference.backend.device})", prompt=prompt, token_ids=ids, band_class=f"backend:{key}",
                     specs=specs)
    res.llamacpp_settings = {"reference": "llorch-ref numpy backend", "backend": key, "device": engine.backend.device}

    def recorded(eng):
        rec = {}

        def recorder(suffix):
            def record(name, layer, arr):
                rec[(name + suffix, layer)] = np.array(eng.backend.to_numpy(arr), dtype=np.float32, copy=True)
            return record
        cache = eng.new_cache()
        logits = eng.backend.to_numpy(eng.forward(ids, cache, record=recorder("")))
        eng.forward(ids[-1:], cache, rows=[0], record=recorder("@step"))         # one decode step
        last = eng.backend.to_numpy(eng.forward(ids, eng.new_cache(), rows=[len(ids) - 1]))[-1]
        return rec, logits, last

    t0 = time.perf_counter()
    rec, ours_logits, ours_last = recorded(engine)
    ref_rec, ref_logits, ref_last = recorded(reference)
    for s in specs:
        bandc = {"agreement": 1.0} if s.id in ("10", "12") else band
        if s.scope == "layer":
            for step, suffix in enumerate(("", "@step")):
                for layer in range(cfg.n_layers):
                    for t in s.tensors_for(cfg):
                        m = compare(rec[(t.ours + suffix, layer)], ref_rec[(t.ours + suffix, layer)])
                        res.rows.append(Row(s.id, s.name, layer, t.ours + suffix, m, bandc, within(m, bandc),
                                            (1 + 0.5 * step, layer, t.order)))   # layers before logits
        elif s.name == "greedy_text":
            if n_greedy > 0:
                a = list(engine.generate_ids(ids, max_tokens=n_greedy, ignore_eos=True))
                b = list(reference.generate_ids(ids, max_tokens=n_greedy, ignore_eos=True))
                n_same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                m = {"shape": [len(a)], "agreement": n_same / n_greedy, "equal_prefix": n_same, "n": n_greedy}
                res.greedy = {"n": n_greedy, "equal_prefix": n_same, "ours": a, "reference": b,
                              "ours_text": engine.tokenizer.decode(a) if engine.tokenizer else "",
                              "reference_text": engine.tokenizer.decode(b) if engine.tokenizer else ""}
                res.rows.append(Row(s.id, s.name, None, "greedy_tokens", m, bandc, within(m, bandc), (3, 99, 0)))
        else:
            cap = types_ns(tensors={(t.llamacpp["name"], t.llamacpp["op"], int(t.llamacpp.get("occurrence", 0))):
                                    ref_rec[(t.ours, None)] for t in s.tensors})
            _model_checkpoint(res, s, bandc, ours_logits, ours_last, ref_logits, ref_last, rec, cap)
    res.captures_ours = {f"{n}.layer{l}" if l is not None else n: a for (n, l), a in rec.items()}
    res.captures_ref = {f"{n}.layer{l}#ref#0" if l is not None else f"{n}#ref#0": a for (n, l), a in ref_rec.items()}
    res.timings["total_s"] = time.perf_counter() - t0
    return res


def types_ns(**kw):
    import types
    return types.SimpleNamespace(**kw)
