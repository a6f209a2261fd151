"""The one comparison: two dumps of the same tokens (any engine, any layout), checkpoint by checkpoint and
layer by layer, each case under its own band; llama.cpp's test-backend-ops is the model. Every source of
tensors (llorch-ref on any backend or numerics, llama.cpp's capture, transformers, a dump file) gives a
Dump or Recorder, and `compare_dumps` compares two of them. What the subject does not hold is reported as
not covered, never as passed. With a local engine, each layer tensor is also compared with the reference
operation run on the subject's own inputs (the teacher-forced, local error), which names the first
divergence where end-to-end errors are inherited.
"""
from __future__ import annotations

import time

import numpy as np

from ..checkpoints import coarser, declaration, greedy_band, load_specs, local_band
from ..dump import Dump, Recorder, catalogue, expected_shape, to_canonical
from ..errors import HarnessError
from .metrics import compare, within
from .result import DiffResult, Row

LAYOUT_CHOICES = {"rope_pairs": ("adjacent", "neox"), "heads": ("token_major", "head_major"),
                  "array_order": ("numpy", "ggml")}


def dims_of(cfg, n_tokens: int, past: int = 0) -> dict:
    """Symbolic dims of the dump shapes for one forward over n_tokens after `past` cached ones."""
    return {"T": n_tokens, "S": past + n_tokens, "H": cfg.n_heads, "KV": cfg.n_kv_heads, "Hd": cfg.head_dim,
            "D": cfg.d_model, "F": cfg.d_ff, "V": cfg.n_vocab, "R": cfg.rope_dim}


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
                  local_bands=local_band, bands=None) -> DiffResult:
    """subject, reference: Dump or Recorder; cfg: the model's Config (for the shapes). -> DiffResult whose
    rows compare subject (as 'ours') with reference; uncovered checkpoints listed in result.not_covered.
    local_engine: the reference engine; every layer tensor (and the head) is then also compared with the
    engine's operation run on the subject's own inputs (the local, teacher-forced error), under the local
    bands of the engine's declared arithmetic, and the first divergence is named by that. local_bands(decl,
    tensor) -> band (calibration passes its own). bands(spec, pos) -> band: the tolerance of each case (default:
    the spec's bands of band_class, coarser from a reduced-precision llama.cpp node on; pos None for token
    checkpoints). Either dump may be a decode step (past_token_ids): both must have run the same past."""
    sub, ref = _as_dump(subject), _as_dump(reference)
    specs = load_specs(checkpoints)
    cat = catalogue()
    ids = sub.token_ids
    if ref.token_ids != ids:
        raise HarnessError(f"the two dumps ran different token ids ({len(ids)} vs {len(ref.token_ids)} tokens; "
                           f"first difference at {next((i for i, (a, b) in enumerate(zip(ids, ref.token_ids)) if a != b), min(len(ids), len(ref.token_ids)))})")
    past = sub.past_token_ids
    if ref.past_token_ids != past:
        raise HarnessError(f"the two dumps ran different pasts ({len(past)} vs {len(ref.past_token_ids)} cached "
                           f"tokens before this forward)")
    dims = dims_of(cfg, len(ids), past=len(past))
    res = DiffResult(model=model or sub.source, reference_model=reference_model or ref.source,
                     prompt=sub.manifest.get("prompt", ""), token_ids=ids, band_class=band_class, specs=specs)
    res.subject_label = subject_label or sub.engine
    res.reference_label = reference_label or ref.engine
    res.sides = {"subject": sub.manifest, "reference": ref.manifest}
    res.not_covered = []
    t0 = time.perf_counter()
    cap_sub, cap_ref = {}, {}
    if local_engine is not None and past:
        res.warnings.append(f"no local (teacher-forced) figures: the dumps hold a decode step after {len(past)} "
                            f"cached tokens, and the local comparison runs fresh-cache forwards only")
        local_engine = None
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

    # a dump written by llama.cpp carries its reduced-precision nodes (spec field band_class): as the
    # spec says, that class's bands apply from the node on
    by_llamacpp = any(str(d.manifest.get("engine", {}).get("name", "")) == "llama.cpp" for d in (sub, ref))
    band_at = bands
    if band_at is None:
        band_at, why = band_schedule(specs, cfg, band_class, llamacpp=by_llamacpp)
        if why:
            res.warnings.append(why)

    for spec in specs:
        band = band_at(spec, None)
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
            if b is not None and a is not None and how == "probs":
                b = b.astype(a.dtype)          # a dump stores probs as float32: compare at that precision
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
        return softmax64(d.get("8", "logits", None, dims)), "softmax(cp8.logits)"
    if d.has("11", "probs"):
        return d.get("11", "probs", None, dims), "probs"
    return None, None



def band_schedule(specs, cfg, band_class, llamacpp: bool = True):
    """-> (band_at(spec, pos), warning or None): the band of a comparison at forward position pos; where one
    side is llama.cpp, the class is made coarser from a reduced-precision llama.cpp node on
    (reduced_precision_from)."""
    floor = reduced_precision_from(specs, cfg, band_class) if llamacpp else None

    def band_at(spec, pos):
        late = floor and pos is not None and pos >= floor["pos"]
        return spec.band(coarser(band_class, floor["class"]) if late else band_class)
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


def softmax64(x):
    """Independent float64 softmax of the reference's logits (not the function under test)."""
    x = np.asarray(x, dtype=np.float64)
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)
