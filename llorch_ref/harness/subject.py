"""Any engine against any other, through dumps: checkpoint by checkpoint, layer by layer.

`compare_dumps(subject, reference, ...)` is the one comparison: both sides are llorch-dump files (or
Recorders) in their own layouts, brought to the canonical layout by their manifests. What the subject
does not hold is reported as not covered, never as passed. `record_engine` turns llorch-ref itself into
a dump, so it can be either side.
"""
from __future__ import annotations

import time

import numpy as np

from ..dump import Dump, Recorder, capture_invariance, catalogue, expected_shape, to_canonical
from ..errors import DumpError, HarnessError
from .metrics import compare, within
from .run import WARMUP_PROMPT, DiffResult, Row, _softmax64, band_schedule
from .specs import declaration, greedy_band, load_specs, local_band

LAYOUT_CHOICES = {"rope_pairs": ("adjacent", "neox"), "heads": ("token_major", "head_major"),
                  "array_order": ("numpy", "ggml")}


def dims_of(cfg, n_tokens: int) -> dict:
    """Symbolic dims of the dump shapes for one fresh forward over n_tokens."""
    return {"T": n_tokens, "S": n_tokens, "H": cfg.n_heads, "KV": cfg.n_kv_heads, "Hd": cfg.head_dim,
            "D": cfg.d_model, "F": cfg.d_ff, "V": cfg.n_vocab, "R": cfg.rope_dim}


def record_engine(engine, token_ids, prompt=None, n_greedy=32) -> Recorder:
    """llorch-ref as a dump (canonical layout): every checkpoint tensor of one forward over token_ids on a
    cache that first ran (and reset after) a warm-up sequence; the last row alone as generation asks for
    it; its argmax and softmax; n_greedy greedy tokens (EOS ignored)."""
    from .. import __version__
    from ..generate import sampling

    rec = Recorder("llorch-ref", f"{__version__} ({engine.backend.name}, {engine.numerics})",
                   model_path=engine.path, token_ids=token_ids, prompt=prompt,
                   layouts={"rope_pairs": engine.config.rope_style},     # Q/K rows as this model holds them
                   extra={"arithmetic": {"numerics": engine.numerics, "kv_dtype": engine.kv_dtype,
                                         "settings": {"backend": engine.backend.name}}})
    ids = list(token_ids)
    if prompt is not None and engine.tokenizer is not None:
        rec.add("cp0.token_ids", np.array(engine.tokenizer.encode(prompt), dtype=np.int64))
    cache = engine.new_cache()
    if engine.tokenizer is not None:
        warm = engine.tokenizer.encode(WARMUP_PROMPT)
        engine.forward(warm, cache, rows=[len(warm) - 1])
        cache.reset()
    b = engine.backend
    logits = b.to_numpy(engine.forward(ids, cache, record=lambda n, l, a: rec(n, l, b.to_numpy(a))))
    rec.add("cp8.logits", logits)
    rec.extra["capture_invariance"] = capture_invariance(logits, b.to_numpy(engine.forward(ids, engine.new_cache())))
    rec.add("cp9.logits", b.to_numpy(engine.forward(ids, engine.new_cache(), rows=[len(ids) - 1]))[-1])
    rec.add("cp10.argmax", np.array([sampling.greedy(r) for r in logits], dtype=np.int64))
    rec.add("cp11.probs", sampling.softmax(logits))
    if n_greedy > 0:
        rec.add("cp12.greedy_tokens", np.array(list(engine.generate_ids(ids, max_tokens=n_greedy, ignore_eos=True)),
                                              dtype=np.int64))
    return rec


def _as_dump(x) -> Dump:
    return x.to_dump() if isinstance(x, Recorder) else x


def _layout_hint(sub: Dump, cp, tensor, layer, entry, dims, ref, band, sub_shape_ok):
    """If another layout declaration makes this tensor fit, say so (the manifest is probably wrong)."""
    for key, choices in LAYOUT_CHOICES.items():
        declared = sub.layouts[key]
        for alt in choices:
            if alt == declared:
                continue
            try:
                a = to_canonical(sub.raw(cp, tensor, layer), entry, {**sub.layouts, key: alt}, dims)
            except ValueError:
                continue
            if list(a.shape) != list(ref.shape):
                continue
            m = compare(a, ref)
            if within(m, band):
                return (f"layout looks wrong: the manifest declares {key}={declared}, but read as {key}={alt} "
                        f"this tensor is inside its band (NMSE {m['nmse']:.3g})")
    if not sub_shape_ok:
        return "shape does not fit the model under any layout declaration"
    return None


def compare_dumps(subject, reference, cfg, band_class: str, checkpoints=None, subject_label=None,
                  reference_label=None, model=None, reference_model=None, local_engine=None,
                  local_bands=local_band) -> DiffResult:
    """subject, reference: Dump or Recorder; cfg: the model's Config (for the shapes). -> DiffResult whose
    rows compare subject (as 'ours') with reference; uncovered checkpoints listed in result.not_covered.
    local_engine: the reference engine; every layer tensor (and the head) is then also compared with the
    engine's operation run on the subject's own inputs (the local, teacher-forced error), under the local
    bands of the engine's declared arithmetic, and the first divergence is named by that. local_bands(decl,
    tensor) -> band (calibration passes its own)."""
    sub, ref = _as_dump(subject), _as_dump(reference)
    specs = load_specs(checkpoints)
    cat = catalogue()
    ids = sub.token_ids
    if ref.token_ids != ids:
        raise HarnessError(f"the two dumps ran different token ids ({len(ids)} vs {len(ref.token_ids)} tokens; "
                           f"first difference at {next((i for i, (a, b) in enumerate(zip(ids, ref.token_ids)) if a != b), min(len(ids), len(ref.token_ids)))})")
    dims = dims_of(cfg, len(ids))
    res = DiffResult(model=model or sub.source, reference_model=reference_model or ref.source,
                     prompt=sub.manifest.get("prompt", ""), token_ids=ids, band_class=band_class, specs=specs)
    res.subject_label = subject_label or sub.engine
    res.reference_label = reference_label or ref.engine
    res.llamacpp_settings = {"subject": sub.manifest, "reference": {k: v for k, v in ref.manifest.items()}}
    res.capture_files = ("subject.npz", "reference.npz")
    res.not_covered = []
    t0 = time.perf_counter()
    cap_sub, cap_ref = {}, {}
    local_of = _local_reader(local_engine, sub, cat, dims, ids) if local_engine is not None else None
    local_decl = declaration(local_engine, sub.arithmetic) if local_engine is not None else None
    if local_engine is not None:
        res.local_declaration = local_decl
    for d, who in ((sub, res.subject_label), (ref, res.reference_label)):
        ci = d.manifest.get("capture_invariance") or {}
        if ci.get("logits_max_abs_diff", 0.0) != 0.0:
            res.warnings.append(f"{who}: the captured run's logits differ from an uncaptured run's by up to "
                                f"{ci['logits_max_abs_diff']:.3g} (the capture changed the computation)")

    def uncovered(spec, layer, tensor, why):
        res.not_covered.append({"checkpoint": spec.id, "name": spec.name, "layer": layer, "tensor": tensor,
                                "why": why})

    def tensor_row(spec, t, layer, band, order):
        e = cat[(spec.id, t)]
        if not ref.has(spec.id, t, layer):
            return uncovered(spec, layer, t, f"the reference ({res.reference_label}) holds no {t}")
        if not sub.has(spec.id, t, layer):
            return uncovered(spec, layer, t, f"the subject ({res.subject_label}) holds no {t}")
        want = expected_shape(e, dims)
        r = ref.get(spec.id, t, layer, dims)
        if list(r.shape) != want:
            raise HarnessError(f"reference {res.reference_label}: {t} layer {layer} has shape {list(r.shape)}, "
                               f"the model needs {want}")
        try:
            s = sub.get(spec.id, t, layer, dims)
        except ValueError as ex:                                       # e.g. a reshape that cannot fit
            s, shape_ok = None, False
            m = {"shape": list(sub.raw(spec.id, t, layer).shape), "ref_shape": want, "max_abs": float("inf"),
                 "nmse": float("inf"), "error": f"cannot bring to the canonical layout: {ex}"}
        else:
            shape_ok = list(s.shape) == want
            m = compare(s, r) if shape_ok else {
                "shape": list(sub.raw(spec.id, t, layer).shape), "ref_shape": want, "max_abs": float("inf"),
                "nmse": float("inf"), "error": f"shape {list(sub.raw(spec.id, t, layer).shape)} (as stored) does "
                f"not give the canonical {e['shape']} = {want} under the declared layouts {sub.layouts}"}
        ok = within(m, band)
        if not ok and (e.get("rope_pairs") or e.get("head_major") or len(want) > 1):
            hint = _layout_hint(sub, spec.id, t, layer, e, dims, r, band, shape_ok)
            if hint:
                m["hint"] = hint
                m["error"] = (m.get("error", "") + "; " if m.get("error") else "") + hint
        key = f"cp{spec.id}.{t}" + ("" if layer is None else f".layer{layer}")
        cap_ref[key] = r
        if s is not None:
            cap_sub[key] = s
        row = Row(spec.id, spec.name, layer, t, m, band, ok, order)
        lo = local_of(spec.id, t, layer) if local_of is not None and s is not None and shape_ok else None
        if lo is not None:
            row.local = compare(s, lo)
            row.local_band = local_bands(local_decl, t)
            row.local_passed = within(row.local, row.local_band)
        res.rows.append(row)

    # a dump written by llama.cpp carries its reduced-precision nodes (spec field band_class): as in run_diff,
    # that class's bands apply from the node on
    by_llamacpp = any(str(d.manifest.get("engine", {}).get("name", "")) == "llama.cpp" for d in (sub, ref))
    band_at, why = band_schedule(specs, cfg, band_class, llamacpp=by_llamacpp)
    if why:
        res.warnings.append(why)

    for spec in specs:
        band = spec.band(band_class)
        if spec.scope == "layer":
            for layer in range(cfg.n_layers):
                for t in spec.tensors_for(cfg):
                    tensor_row(spec, t.ours, layer, band_at(spec, (1, layer, t.order)), (1, layer, t.order))
            continue
        num = int("".join(c for c in spec.id if c.isdigit()) or 0)
        order = (2, 0, num)
        if spec.id in ("8", "9", "11"):
            band = band_at(spec, (2, 0, num - 0.5))
        if spec.id == "0":
            if not sub.has("0", "token_ids"):
                uncovered(spec, None, "token_ids", "the subject holds no cp0.token_ids (its own tokenization)")
            elif not ref.has("0", "token_ids"):
                uncovered(spec, None, "token_ids", "the reference holds no cp0.token_ids")
            else:
                a, b = sub.raw("0", "token_ids").tolist(), ref.raw("0", "token_ids").tolist()
                m = {"shape": [len(a)], "ref_shape": [len(b)], "agreement": 1.0 if a == b else 0.0,
                     "ours": a, "reference": b}
                res.rows.append(Row("0", spec.name, None, "token_ids", m, band, within(m, band), (0, 0, 0)))
        elif spec.id in ("8", "9"):
            for t in [d["name"] for d in spec.dump]:
                tensor_row(spec, t, None, band, (2, 0, num - 0.5 if t == "result_norm" else num))
        elif spec.id == "10":
            a, how_a = _argmax(sub)
            b, how_b = _argmax(ref)
            if a is None or b is None:
                uncovered(spec, None, "argmax", "no cp10.argmax and no cp8.logits to derive it from")
            else:
                m = {"shape": list(a.shape), "agreement": float((a == b).mean()) if a.shape == b.shape else 0.0,
                     "ours": a.tolist(), "reference": b.tolist()}
                row = Row("10", spec.name, None, how_a, m, band, within(m, band), order)
                if local_engine is not None and sub.has("8", "logits"):
                    own = sub.raw("8", "logits").reshape(len(ids), -1).argmax(-1)   # argmax of its own logits
                    _token_local(row, {"agreement": float((a == own).mean()) if a.shape == own.shape else 0.0})
                res.rows.append(row)
                cap_sub["cp10.argmax"], cap_ref["cp10.argmax"] = a, b
        elif spec.id == "11":
            a, how = _probs(sub, dims)
            b, _ = _probs(ref, dims, float64=True)
            if a is None or b is None:
                uncovered(spec, None, "probs", "no cp11.probs and no cp8.logits to derive them from")
            else:
                m = compare(a, b)
                res.rows.append(Row("11", spec.name, None, how, m, band, within(m, band), order))
        elif spec.id == "12":
            if not sub.has("12", "greedy_tokens") or not ref.has("12", "greedy_tokens"):
                uncovered(spec, None, "greedy_tokens", "the subject holds no cp12.greedy_tokens"
                          if not sub.has("12", "greedy_tokens") else "the reference holds no cp12.greedy_tokens")
            else:
                a, b = sub.raw("12", "greedy_tokens").tolist(), ref.raw("12", "greedy_tokens").tolist()
                n = min(len(a), len(b))
                same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), n)
                m = {"shape": [len(a)], "ref_shape": [len(b)], "agreement": same / max(n, 1), "equal_prefix": same,
                     "n": n}
                res.greedy = {"n": n, "equal_prefix": same, "ours": a, "reference": b, "ours_text": "",
                              "reference_text": ""}
                gb = greedy_band(band, n)
                row = Row("12", spec.name, None, "greedy_tokens", m, gb, within(m, gb), (3, 99, 0))
                if local_engine is not None and a and sub.has("8", "logits"):
                    # teacher-forced, the first greedy token is the argmax of the subject's own last logits;
                    # later tokens need the subject's decode steps (not in a one-forward dump)
                    own = int(sub.raw("8", "logits").reshape(len(ids), -1)[-1].argmax())
                    _token_local(row, {"agreement": 1.0 if a[0] == own else 0.0, "first_token": a[0],
                                       "argmax_of_own_logits": own})
                    if not row.passed:
                        res.warnings.append(
                            f"greedy tokens part at token {same} of {n} end to end, with every local check inside "
                            f"its band: a near-tie flip of the declared arithmetic, or a bug in the decode steps, "
                            f"which a one-forward dump cannot localize")
                res.rows.append(row)
                cap_sub["cp12.greedy_tokens"], cap_ref["cp12.greedy_tokens"] = np.array(a), np.array(b)
        else:
            raise HarnessError(f"{spec.path}: checkpoint {spec.id} has no dump comparison")
    res.captures_ours, res.captures_ref = cap_sub, cap_ref
    res.timings["compare_s"] = time.perf_counter() - t0
    return res


def _token_local(row, m: dict):
    """A token checkpoint's local figure: the subject's tokens against its own logits (exact agreement)."""
    row.local, row.local_band = {"shape": row.metrics.get("shape"), **m}, {"agreement": 1.0}
    row.local_passed = within(row.local, row.local_band)


def _local_reader(engine, sub: Dump, cat: dict, dims: dict, token_ids):
    """-> local(cp, tensor, layer): the engine's op on the subject's inputs, or None (inputs not held).
    Layers are computed once, on first use."""
    from .local import local_outputs, model_outputs

    where = {name: cp for (cp, name) in cat}
    memo = {}
    fused = bool(((sub.arithmetic or {}).get("settings") or {}).get("flash_attn"))

    def get(name, layer):
        cp = where.get(name)
        if cp is None or not sub.has(cp, name, layer):
            return None
        try:
            a = sub.get(cp, name, layer, dims)
        except ValueError:
            return None
        return a if list(a.shape) == expected_shape(cat[(cp, name)], dims) else None

    def local(cp, tensor, layer):
        key = "head" if layer is None else layer
        if key not in memo:
            memo[key] = (model_outputs(engine, get) if layer is None else
                         local_outputs(engine, get, layer, token_ids, fused_attention=fused))
        lo = memo[key].get(tensor)
        if cp == "9" and lo is not None:            # the last row alone, from the subject's own result_norm
            return lo[-1]
        return lo
    return local


def _argmax(d: Dump):
    if d.has("10", "argmax"):
        return d.raw("10", "argmax").astype(np.int64), "argmax"
    if d.has("8", "logits"):
        return d.raw("8", "logits").reshape(len(d.token_ids), -1).argmax(-1), "argmax(cp8.logits)"
    return None, None


def _probs(d: Dump, dims, float64=False):
    if d.has("11", "probs") and not float64:
        return d.get("11", "probs", None, dims), "probs"
    if d.has("8", "logits"):
        return _softmax64(d.get("8", "logits", None, dims)), "softmax(cp8.logits)"
    if d.has("11", "probs"):
        return d.get("11", "probs", None, dims), "probs"
    return None, None


def engine_label(engine) -> str:
    from .. import __version__
    return f"llorch-ref {__version__} ({engine.backend.name}, {engine.numerics}, K/V {engine.kv_dtype})"


def run_subject(engine, sub: Dump, band_class: str, checkpoints=None, subject_label=None, n_greedy=None,
                log=None) -> DiffResult:
    """A dump under test against llorch-ref on `engine` (the reference), on the dump's token ids; the greedy
    continuation as long as the subject's (or n_greedy). Shared by `diff --subject` and the pytest plugin."""
    check_dump_fits(sub, engine.config)
    warn = check_same_model(sub, engine)
    n = n_greedy or (len(sub.raw("12", "greedy_tokens")) if sub.has("12", "greedy_tokens") else 0)
    if log:
        log(f"llorch-ref: running the reference on the dump's {len(sub.token_ids)} tokens"
            + (f" and {n} greedy tokens" if n else "") + " ...")
    ref = record_engine(engine, sub.token_ids, prompt=sub.manifest.get("prompt"), n_greedy=n)
    res = compare_dumps(sub, ref, engine.config, band_class, checkpoints=checkpoints,
                        subject_label=subject_label or sub.engine, reference_label=engine_label(engine),
                        model=sub.source, reference_model=str(engine.path), local_engine=engine)
    if warn:
        res.warnings.append(warn)
    return res


def check_same_model(sub: Dump, engine) -> str | None:
    """-> a warning line when the subject ran another file than the reference model (or None)."""
    from ..dump import model_sha256
    theirs = sub.manifest["model"].get("sha256", "unknown")
    ours = model_sha256(engine.path)
    if theirs == "unknown":
        return f"the subject's manifest gives no model sha256: cannot check it ran {engine.path}"
    if theirs != ours:
        return (f"the subject ran model sha256 {theirs[:12]}… ({sub.manifest['model'].get('path', '')}); the "
                f"reference runs {engine.path} (sha256 {ours[:12]}…): different files (a conversion?)")
    return None


def check_dump_fits(sub: Dump, cfg):
    """Layer indices inside the model (the shapes are checked per tensor)."""
    for (cp, t, layer) in sub.index:
        if layer is not None and layer >= cfg.n_layers:
            raise DumpError(f"{sub.source}: tensor {sub.index[(cp, t, layer)]} names layer {layer}, but the model "
                            f"has {cfg.n_layers} layers (0..{cfg.n_layers - 1})")
    if max(sub.token_ids) >= cfg.n_vocab:
        raise DumpError(f"{sub.source}: token id {max(sub.token_ids)} in the manifest is outside the model's "
                        f"vocabulary of {cfg.n_vocab}")
