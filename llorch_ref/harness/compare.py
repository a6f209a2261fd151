"""The one comparison: two dumps of the same tokens (any engine, any layout), checkpoint by checkpoint and
layer by layer, each case under its own band; llama.cpp's test-backend-ops is the model. Every source of
tensors (llorch-ref on any backend or numerics, llama.cpp's capture, transformers, a dump file) gives a
Dump or Recorder, and `compare_dumps` compares two of them. What the subject does not hold is reported as
not covered, never as passed. With a local engine, each layer tensor is also compared with the reference
operation run on the subject's own inputs (the teacher-forced, local error), which names the first
divergence where end-to-end errors are inherited.
"""
from __future__ import annotations

import math
import time

import numpy as np

from ..checkpoints import coarser, declaration, greedy_band, load_specs, local_band
from ..dump import SCORE_TENSORS, Dump, Recorder, catalogue, expected_shape, neox_pairs, to_canonical, token_axis
from ..errors import HarnessError
from .local import last_row, local_outputs, model_outputs, visible
from .metrics import compare, nmse_by_row, within
from .result import DiffResult, Row

LAYOUT_CHOICES = {"rope_pairs": ("adjacent", "neox"), "heads": ("token_major", "head_major"),
                  "array_order": ("numpy", "ggml")}


def dims_of(cfg, n_tokens: int, past: int = 0, n_rows: int | None = None) -> dict:
    """Symbolic dims of the dump shapes for one forward over n_tokens after `past` cached ones, of which
    n_rows rows are held (default: all)."""
    return {"T": n_tokens if n_rows is None else n_rows, "S": past + n_tokens, "H": cfg.n_heads, "KV": cfg.n_kv_heads, "Hd": cfg.head_dim,
            "D": cfg.d_model, "F": cfg.d_ff, "V": cfg.n_vocab, "R": cfg.rope_dim}


def _as_dump(x) -> Dump:
    return x.to_dump() if isinstance(x, Recorder) else x


def _rows_outside(a, b, rows, band) -> list[int]:
    """The rows (first axis) of `rows` whose own figures leave the band."""
    return [int(p) for p in rows if not within(compare(a[p:p + 1], b[p:p + 1]), band)]


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
                  local_bands=local_band, bands=None, _step=0, _written=None) -> DiffResult:
    """subject, reference: Dump or Recorder; cfg: the model's Config (for the shapes). -> DiffResult whose
    rows compare subject (as 'ours') with reference; uncovered checkpoints listed in result.not_covered.
    local_engine: the reference engine; every layer tensor (and the head) is then also compared with the
    engine's operation run on the subject's own inputs (the local, teacher-forced error), under the local
    bands of the engine's declared arithmetic, and the first divergence is named by that. local_bands(decl,
    tensor) -> band (calibration passes its own). bands(spec, pos) -> band: the tolerance of each case (default:
    the spec's bands of band_class, coarser from a reduced-precision llama.cpp node on; pos None for token
    checkpoints). Either dump may be a decode step (past_token_ids): both must have run the same past.
    _written: {(cache tensor, layer): the subject's cache rows as its earlier forwards wrote them} (decode
    steps read their past rows against it)."""
    sub, ref = _as_dump(subject), _as_dump(reference)
    _check_same_run(sub, ref)
    specs = load_specs(checkpoints)
    res = DiffResult(model=model or sub.source, reference_model=reference_model or ref.source,
                     prompt=sub.manifest.get("prompt", ""), token_ids=sub.token_ids, band_class=band_class,
                     specs=specs, subject_label=subject_label or sub.engine,
                     reference_label=reference_label or ref.engine,
                     sides={"subject": sub.manifest, "reference": ref.manifest}, config=cfg)
    t0 = time.perf_counter()
    written = {} if _written is None else _written
    c = _Comparison(sub, ref, cfg, res, local_engine, local_bands, step=_step, written=written)
    res.positions = [int(p) for p in c.positions]
    band_at = bands or c.default_bands(specs, band_class)
    for spec in specs:
        if spec.scope != "layer" and spec.id not in _MODEL_CASES:
            raise HarnessError(f"{spec.path}: checkpoint {spec.id} has no dump comparison")
    rank = {}                      # row -> its spec's place: the rows come out in spec order, as the specs list them
    for layer in range(cfg.n_layers):              # layer by layer: one layer's tensors (and local outputs) at a time
        for i, spec in enumerate(specs):
            if spec.scope == "layer":
                for t in spec.tensors_for(cfg):
                    pos = (1, layer, t.order)
                    n = len(res.rows)
                    c.tensor(spec, t.ours, layer, band_at(spec, pos), c.order(*pos))
                    rank.update({id(r): i for r in res.rows[n:]})
        c.done_with_layer(layer)
    for i, spec in enumerate(specs):
        if spec.scope != "layer":
            pos = (2, 0, spec.order - 0.5) if spec.after_last_layer else None
            n = len(res.rows)
            _MODEL_CASES[spec.id](c, spec, band_at(spec, pos), spec.order)
            rank.update({id(r): i for r in res.rows[n:]})
    res.rows.sort(key=lambda r: rank.get(id(r), len(specs)))
    res.captures_ours, res.captures_ref = c.cap_sub, c.cap_ref
    for k in sorted(set(sub.steps) | set(ref.steps)):
        _compare_step(sub, ref, k, cfg, res, specs, band_at, local_engine, local_bands, written)
    res.timings["compare_s"] = time.perf_counter() - t0
    return res


def _compare_step(sub: Dump, ref: Dump, k: int, cfg, res: DiffResult, specs, band_at, local_engine, local_bands,
                  written):
    """Decode step k of both dumps, compared as a forward of its own (one token after a past), its rows
    named '<tensor>@step<k>' and ordered after the prompt's; a step one side lacks is not covered."""
    if sub.decode_token_ids[:k] != ref.decode_token_ids[:k]:
        raise HarnessError(f"the two dumps fed different decode tokens up to step {k}: {sub.decode_token_ids[:k]} vs "
                           f"{ref.decode_token_ids[:k]} (a teacher-forced comparison runs both on the same tokens)")
    for d, who in ((sub, "subject"), (ref, "reference")):
        if k not in d.steps:
            res.not_covered.append({"checkpoint": "steps", "name": "decode step", "layer": None, "tensor": f"@step{k}",
                                    "why": f"the {who} holds no tensors of decode step {k}"})
            return
    wanted = [s.id for s in specs if s.every_step()]
    r = compare_dumps(sub.step_view(k), ref.step_view(k), cfg, res.band_class, checkpoints=wanted,
                      subject_label=res.subject_label, reference_label=res.reference_label, bands=band_at, _step=k,
                      local_engine=local_engine, local_bands=local_bands, _written=written)
    for row in r.rows:
        row.step, row.tensor = k, f"{row.tensor}@step{k}"
    res.rows += r.rows
    res.not_covered += [{**u, "tensor": f"{u['tensor']}@step{k}"} for u in r.not_covered]
    res.warnings += [w for w in r.warnings if w not in res.warnings]
    res.captures_ours.update({f"{key}.step{k}": a for key, a in r.captures_ours.items()})
    res.captures_ref.update({f"{key}.step{k}": a for key, a in r.captures_ref.items()})


def _check_same_run(sub: Dump, ref: Dump):
    ids, other = sub.token_ids, ref.token_ids
    if other != ids:
        first = next((i for i, (a, b) in enumerate(zip(ids, other)) if a != b), min(len(ids), len(other)))
        raise HarnessError(f"the two dumps ran different token ids ({len(ids)} vs {len(other)} tokens; first "
                           f"difference at {first})")
    if ref.rows != sub.rows:
        raise HarnessError(f"the two dumps hold different rows of the forward ({len(sub.rows)} vs {len(ref.rows)}; "
                           f"a comparison runs the reference with the subject's rows)")
    if ref.score_rows != sub.score_rows:
        raise HarnessError(f"the two dumps hold the attention scores at different rows ({len(sub.score_rows)} vs "
                           f"{len(ref.score_rows)}; a comparison runs the reference with the subject's score rows)")
    if ref.past_token_ids != sub.past_token_ids:
        raise HarnessError(f"the two dumps ran different pasts ({len(sub.past_token_ids)} vs "
                           f"{len(ref.past_token_ids)} cached tokens before this forward)")


class _Comparison:
    """The state of one comparison: both dumps, their dims, the result being filled, the local reader.
    One method per kind of case; each adds a row (or a not-covered entry) to the result."""

    def __init__(self, sub: Dump, ref: Dump, cfg, res: DiffResult, local_engine, local_bands, step: int = 0,
                 written=None):
        self.sub, self.ref, self.cfg, self.res, self.step = sub, ref, cfg, res, step
        self.written = {} if written is None else written
        self.cat = catalogue()
        self.n = len(sub.rows)
        self.past = len(sub.past_token_ids)
        self.positions = np.asarray(sub.rows) + self.past        # the absolute position of each row held
        self.dims = dims_of(cfg, len(sub.token_ids), past=self.past, n_rows=self.n)
        self.score_positions = np.asarray(sub.score_rows) + self.past
        self.score_dims = {**self.dims, "T": len(sub.score_rows)}
        self.sampled_scores = len(sub.score_rows) != self.n
        self.score_index = [sub.rows.index(r) for r in sub.score_rows] if self.sampled_scores else None
        # with a dump on disk (a file, a store), tensors are read when compared and dropped: the captures
        # are read again when asked for (a bundle), never held
        self.on_disk = any(type(d.tensors) is not dict for d in (sub, ref))
        self.cap_sub, self.cap_ref = (LazyCaptures(), LazyCaptures()) if self.on_disk else ({}, {})
        self.keep_written = step > 0 or bool(sub.steps or ref.steps)      # decode steps read the cache rows
        self.local_engine, self.local_bands = local_engine, local_bands
        self.local_of, self.local_decl = None, None
        if local_engine is not None:
            self.local_of = _LocalReader(local_engine, sub, self.cat, self.dims, self.positions, self.score_index)
            self.local_decl = res.local_declaration = declaration(local_engine, sub.arithmetic)
        for d, who in ((sub, res.subject_label), (ref, res.reference_label)):
            diff = (d.manifest.get("capture_invariance") or {}).get("logits_max_abs_diff", 0.0)
            if diff != 0.0:
                res.warnings.append(f"{who}: the captured run's logits differ from an uncaptured run's by up to "
                                    f"{diff:.3g} (the capture changed the computation)")

    def default_bands(self, specs, band_class):
        """The spec bands; a dump written by llama.cpp carries its reduced-precision nodes (spec field
        band_class), whose class then applies from the node on."""
        by_llamacpp = any(str(d.manifest.get("engine", {}).get("name", "")) == "llama.cpp"
                          for d in (self.sub, self.ref))
        band_at, why = band_schedule(specs, self.cfg, self.res.band_class, llamacpp=by_llamacpp)
        if why:
            self.res.warnings.append(why)
        return band_at

    def order(self, phase, *rest) -> tuple:
        """A row's place in the first-divergence order: the phase (0 tokenizer, 1 layer tensors, 2 head and
        tokens, 3 greedy text), then the decode step, then its place in the forward. With teacher-forced
        tokens a decode step's layers depend on the layers before them only, never on a head."""
        return (phase, self.step, *rest)

    def uncovered(self, spec, layer, tensor, why):
        self.res.not_covered.append({"checkpoint": spec.id, "name": spec.name, "layer": layer, "tensor": tensor,
                                     "why": why})

    def both_hold(self, spec, tensor, layer=None) -> bool:
        """Whether both sides hold the tensor; if not, it is recorded as not covered (never as passed), naming
        the subject first where neither holds it (a reference is run on what the subject gives: no prompt in the
        subject's manifest, no tokenization on either side)."""
        for d, who in ((self.sub, "subject"), (self.ref, "reference")):
            if not d.has(spec.id, tensor, layer):
                label = self.res.reference_label if who == "reference" else self.res.subject_label
                why = f"the {who} ({label}) holds no cp{spec.id}.{tensor}"
                if spec.id == "0" and "prompt" not in self.sub.manifest:
                    why += " (the subject's manifest names no prompt to tokenize)"
                self.uncovered(spec, layer, tensor, why)
                return False
        return True

    def tensor(self, spec, t, layer, band, order):
        """A tensor case: both sides in the canonical layout, end-to-end figures, a layout hint when another
        declaration would fit, and the local figure where a reference engine is given."""
        if not self.both_hold(spec, t, layer):
            return
        e, sub = self.cat[(spec.id, t)], self.sub
        dims = self.dims_for(t)
        want = expected_shape(e, dims)
        if self.by_spans(e, t, layer, want):
            return self.tensor_by_spans(spec, t, layer, band, order, e, want)
        r = self.ref.get(spec.id, t, layer, dims)
        if list(r.shape) != want:
            raise HarnessError(f"reference {self.res.reference_label}: {t} layer {layer} has shape "
                               f"{list(r.shape)}, the model needs {want}")
        if t == "kq":
            r = self.seen_scores(r, layer)
        s, m = self._subject_tensor(spec, t, layer, e, want, r)
        ok = within(m, band)
        if not ok and (e.get("rope_pairs") or e.get("head_major") or len(want) > 1):
            hint = _layout_hint(sub, spec.id, t, layer, e, self.dims, r, band, s is not None)
            if hint:
                m["hint"] = hint
                m["error"] = (m.get("error", "") + "; " if m.get("error") else "") + hint
        key = f"cp{spec.id}.{t}" + ("" if layer is None else f".layer{layer}")
        if self.on_disk:
            self.cap_ref.later(key, self.reader(self.ref, spec.id, t, layer))
            if s is not None:
                self.cap_sub.later(key, self.reader(self.sub, spec.id, t, layer))
        else:
            self.cap_ref[key] = r
            if s is not None:
                self.cap_sub[key] = s
        row = Row(spec.id, spec.name, layer, t, m, band, ok, order)
        lo = self.local_of(spec.id, t, layer) if self.local_of is not None and s is not None else None
        if lo is not None and t in SCORE_TENSORS and self.sampled_scores and np.ndim(lo) == 3 \
                and lo.shape[1] == self.n:
            lo = lo[:, self.score_index]               # the local op ran on every row held: the score rows of it
        if lo is not None and t == "kq":
            lo = self.seen_scores(lo, layer)
        if lo is not None and t in ("k_cache", "v_cache"):
            self.cache_local(row, s, r, lo, t, layer)
        elif lo is not None:
            row.local = compare(s, lo)
            row.local_band = self.rope_floor(t, self.local_bands(self.local_decl, t))
            row.local_passed = within(row.local, row.local_band)
        ax = token_axis(e)
        if ax is not None and s is not None and self.step == 0:
            row.by_position = self.spread({"nmse": nmse_by_row(s, r, ax)}, t)
            if lo is not None and np.shape(lo) == np.shape(s):
                row.by_position["local_nmse"] = self.spread({"x": nmse_by_row(s, lo, ax)}, t)["x"]
        self.res.rows.append(row)

    def dims_for(self, t: str) -> dict:
        """The dims of a tensor: the attention scores' T is the score rows' count where they are sampled."""
        return self.score_dims if t in SCORE_TENSORS else self.dims

    def spread(self, figs: dict, t: str) -> dict:
        """Per-row figures of the score rows -> one per row held (None where the scores were not held)."""
        if t not in SCORE_TENSORS or not self.sampled_scores:
            return figs
        at = {int(p): i for i, p in enumerate(self.score_positions)}
        return {k: [v[at[int(p)]] if int(p) in at else None for p in self.positions] for k, v in figs.items()}

    def reader(self, d: Dump, cp, t, layer):
        """-> a function reading the tensor again in the canonical layout (a lazy capture)."""
        dims = self.dims_for(t)

        def read():
            a = d.get(cp, t, layer, dims)
            return self.seen_scores(a, layer) if t == "kq" else a
        return read

    def done_with_layer(self, layer):
        """Every case of this layer compared: its local outputs are dropped."""
        if self.local_of is not None:
            self.local_of.forget(layer)

    def by_spans(self, e, t, layer, want) -> bool:
        """Whether a tensor is compared a span of rows at a time: a model tensor [T, X] (logits, probabilities)
        over SPAN_BYTES, without a local figure, whose canonical layout is its bytes (no Q/K pairs, no heads)."""
        return (layer is None and len(want) == 2 and 4 * want[0] * want[1] > SPAN_BYTES and self.step == 0
                and self.local_engine is None and not e.get("rope_pairs") and not e.get("head_major")
                and self.sub.shape_of(*self.key_of(t), layer) in (want, want[::-1])
                and self.ref.shape_of(*self.key_of(t), layer) in (want, want[::-1]))

    def probs_by_spans(self) -> bool:
        """Whether checkpoint 11 is compared a span of rows at a time (by_spans' rule, on the logits [T, V])."""
        if self.step or self.local_engine is not None or not self.ref.has("8", "logits"):
            return False
        want = [self.n, self.cfg.n_vocab]
        if 4 * want[0] * want[1] <= SPAN_BYTES or self.ref.shape_of("8", "logits") not in (want, want[::-1]):
            return False
        name = ("11", "probs") if self.sub.has("11", "probs") else ("8", "logits")
        return self.sub.has(*name) and self.sub.shape_of(*name) in (want, want[::-1])

    def key_of(self, t):
        return next(k for k in self.cat if k[1] == t)

    def tensor_by_spans(self, spec, t, layer, band, order, e, want):
        """tensor(), a span of rows at a time (compare_by_spans: the same figures); the capture read again
        when asked for."""
        n = want[0]
        m, per_row = compare_by_spans(lambda a, b: self.sub.read_rows(spec.id, t, a, b, n, layer),
                                      lambda a, b: self.ref.read_rows(spec.id, t, a, b, n, layer), n)
        key = f"cp{spec.id}.{t}"
        for caps, d in ((self.cap_ref, self.ref), (self.cap_sub, self.sub)):
            if self.on_disk:
                caps.later(key, self.reader(d, spec.id, t, layer))
            else:
                caps[key] = d.get(spec.id, t, layer, self.dims)
        row = Row(spec.id, spec.name, layer, t, m, band, within(m, band), order)
        if self.step == 0:
            row.by_position = {"nmse": per_row}
        self.res.rows.append(row)

    def cache_local(self, row, s, r, lo, t, layer):
        """The local figure of a cache tensor [S, KV, Hd] covers every row the attention reads: the rows this
        forward wrote at its positions against the reference's store of the subject's new K/V (lo); the rows
        an earlier forward wrote against the subject's own earlier write of them (a decode step's past: an
        eviction, ring-buffer or overwrite bug changes them); and past rows never held as an earlier write
        (a rows-only dump's unheld prompt positions) end to end against the reference, in the end-to-end band
        (row.band). The subject's cache as held here is then the earlier write of the next decode step."""
        n = s.shape[0]
        new = sorted({int(p) for p in self.positions if p < n})
        earlier = self.written.get((t, layer))
        past = [p for p in range(n) if p not in set(new)]
        known = [p for p in past if earlier is not None and p < earlier.shape[0]]
        unknown = [p for p in past if p not in set(known)]
        want = np.array(lo, dtype=np.float32, copy=True)
        if known:
            want[known] = earlier[known]
        checked = sorted(new + known)
        row.local = compare(s[checked], want[checked])
        row.local_band = self.local_bands(self.local_decl, t)
        row.local_passed = within(row.local, row.local_band)
        row.local["rows"] = {"written": len(new), "against_earlier_write": len(known),
                             "against_reference": len(unknown)}
        bad = [] if row.local_passed else _rows_outside(s, want, checked, row.local_band)
        if bad:
            old = [p for p in bad if p in set(known)]
            row.local["error"] = (f"cache rows at positions {bad[:8]} differ from "
                                  + ("the subject's own earlier write of them (a cache row changed after it was "
                                     "written)" if old else "the reference's store of the subject's new K/V"))
        if unknown:
            m = compare(s[unknown], r[unknown])
            row.local["unheld_rows_end_to_end"] = {**m, "positions": unknown[:16], "n": len(unknown)}
            if not within(m, row.band):
                row.local_passed = False
                bad += _rows_outside(s, r, unknown, row.band) or unknown
                row.local["error"] = (f"cache rows at positions {bad[:8]}, which no forward held as rows, are outside "
                                      f"the end-to-end band against the reference (NMSE {m['nmse']:.3g})")
        if bad:
            row.local["bad_positions"] = sorted(set(bad))[:64]
        if self.keep_written:
            self.written[(t, layer)] = np.array(s, dtype=np.float32, copy=True)

    def _subject_tensor(self, spec, t, layer, e, want, r):
        """-> (the subject's tensor in the canonical layout, or None where it cannot be brought there or has
        the wrong shape; the figures, infinite with the reason in that case)."""
        stored = self.sub.shape_of(spec.id, t, layer)
        bad = {"shape": stored, "ref_shape": want, "max_abs": float("inf"), "nmse": float("inf")}
        try:
            s = self.sub.get(spec.id, t, layer, self.dims_for(t))
        except ValueError as ex:                                       # e.g. a reshape that cannot fit
            return None, {**bad, "error": f"cannot bring to the canonical layout: {ex}"}
        if list(s.shape) != want:
            return None, {**bad, "error": f"shape {stored} (as stored) does not give the canonical {e['shape']} = "
                                          f"{want} under the declared layouts {self.sub.layouts}"}
        if t == "kq":
            s = self.seen_scores(s, layer)
        return s, compare(s, r)

    def rope_floor(self, tensor: str, band: dict) -> dict:
        """RoPE outputs under exact float32: two correct constructions of the angle p * theta_i in float32 (ggml's
        theta *= scale, transformers' p * inv_freq) differ by about p * 2^-23 rad at position p, so the local band
        of q and k is at least (p_max * 2^-23)^2 in NMSE (4.9e-9 at position 600, 2.4e-7 at 4096; an off-by-one
        position gives about 1). The calibrated band holds at short prompts; ggml's declared arithmetic is
        reproduced bit for bit and keeps its own."""
        if tensor not in ("q", "k") or not str(self.local_decl).startswith("exact") or "nmse" not in band:
            return band
        floor = (float(self.positions.max()) * 2.0 ** -23) ** 2 if len(self.positions) else 0.0
        return {**band, "nmse": max(band["nmse"], floor)} if floor > band["nmse"] else band

    def seen_scores(self, a, layer):
        """Raw scores [H, T, S] with the entries no query may see set to 0: a query's scores against later
        positions (or outside a local layer's window) are no part of the result, and an engine that fed the
        prompt in micro-batches never computes them."""
        pos = self.score_positions if a.shape[-2] == len(self.score_positions) else self.positions
        seen = visible(self.cfg, layer, pos, a.shape[-1])
        return np.where(seen[None], a, np.float32(0)).astype(np.float32)

    def own_logits(self):
        """The subject's own logits [T, V], or None: the teacher-forced source of its tokens."""
        return self.sub.raw("8", "logits").reshape(self.n, -1) if self.sub.has("8", "logits") else None


def _case_token_ids(c: _Comparison, spec, band, num):
    """The subject's tokenization against the reference's: the ids its tensors ran (the manifest's token_ids)
    must be the reference's tokenization of the prompt it names, and its own cp0.token_ids where it holds them."""
    ran = _case_ran_ids(c, spec, band)
    if ran and not c.sub.has("0", "token_ids"):
        return
    if not c.both_hold(spec, "token_ids"):
        return
    a, b = c.sub.raw("0", "token_ids").tolist(), c.ref.raw("0", "token_ids").tolist()
    m = {"shape": [len(a)], "ref_shape": [len(b)], "agreement": 1.0 if a == b else 0.0, "ours": a, "reference": b}
    c.res.rows.append(Row("0", spec.name, None, "token_ids", m, band, within(m, band), c.order(0, 0, 0)))
    c.cap_sub["cp0.token_ids"], c.cap_ref["cp0.token_ids"] = np.array(a, np.int64), np.array(b, np.int64)


def _case_ran_ids(c: _Comparison, spec, band) -> bool:
    """A row comparing the ids the subject ran with the reference's tokenization of the subject's prompt
    (where both exist): a dump whose prompt is not what its tensors ran fails here. -> whether it was made."""
    prompt = c.sub.manifest.get("prompt")
    if prompt is None or c.step or not c.ref.has("0", "token_ids"):
        return False
    ran, b = c.sub.token_ids, c.ref.raw("0", "token_ids").tolist()
    m = {"shape": [len(ran)], "ref_shape": [len(b)], "agreement": 1.0 if ran == b else 0.0, "ours": ran, "reference": b}
    if ran != b:
        at = next((i for i, (x, y) in enumerate(zip(ran, b)) if x != y), min(len(ran), len(b)))
        m["error"] = (f"the manifest's prompt tokenizes to {len(b)} ids, but the dump's tensors ran {len(ran)} other "
                      f"token_ids (first difference at index {at}): the prompt shown is not what ran")
    c.res.rows.append(Row("0", spec.name, None, "ran_token_ids", m, band, within(m, band), c.order(0, 0, -1)))
    return True


def _case_head(c: _Comparison, spec, band, num):
    for t in [d["name"] for d in spec.dump]:
        c.tensor(spec, t, None, band, c.order(2, 0, num - 0.5 if t == "result_norm" else num))


def _case_argmax(c: _Comparison, spec, band, num):
    (a, how), (b, _) = _argmax(c.sub), _argmax(c.ref)
    if a is None or b is None:
        return c.uncovered(spec, None, "argmax", "no cp10.argmax and no cp8.logits to derive it from")
    m = {"shape": list(a.shape), "agreement": float((a == b).mean()) if a.shape == b.shape else 0.0,
         "ours": a.tolist(), "reference": b.tolist()}
    row = Row("10", spec.name, None, how, m, band, within(m, band), c.order(2, 0, num))
    own = c.own_logits()
    if c.local_engine is not None and own is not None:
        own = own.argmax(-1)                                  # the argmax of its own logits
        _token_local(row, {"agreement": float((a == own).mean()) if a.shape == own.shape else 0.0})
    c.res.rows.append(row)
    c.cap_ref["cp10.argmax"] = b
    if how == "argmax":                       # what the subject stored (a derived argmax comes from its logits)
        c.cap_sub["cp10.argmax"] = a


def _case_probs(c: _Comparison, spec, band, num):
    if c.probs_by_spans():
        return _case_probs_by_spans(c, spec, band, num)
    a, how = _probs(c.sub, c.dims)
    b, _ = _probs(c.ref, c.dims, float64=True)
    if a is None or b is None:
        return c.uncovered(spec, None, "probs", "no cp11.probs and no cp8.logits to derive them from")
    if how == "probs":
        b = b.astype(a.dtype)                  # a dump stores probs as float32: compare at that precision
    m = compare(a, b)
    row = Row("11", spec.name, None, how, m, band, within(m, band), c.order(2, 0, num))
    own = c.own_logits()
    if c.local_engine is not None and own is not None:
        # teacher-forced: the softmax of the subject's own logits (exact by construction where the probs are
        # derived from them; a real check where the subject stored its own)
        row.local = compare(a, softmax64(own).astype(a.dtype))
        row.local_band = c.local_bands(c.local_decl, "probs") if how == "probs" else {"max_abs": 0.0}
        row.local_passed = within(row.local, row.local_band)
    c.res.rows.append(row)
    c.cap_ref["cp11.probs"] = np.asarray(b, np.float32)
    if how == "probs" and c.on_disk:          # what the subject stored (derived probabilities come from its logits)
        c.cap_sub.later("cp11.probs", lambda: c.sub.get("11", "probs", None, c.dims))
    elif how == "probs":
        c.cap_sub["cp11.probs"] = a


def _case_probs_by_spans(c: _Comparison, spec, band, num):
    """_case_probs a span of rows at a time (a long prompt's [T, V]): the subject's probabilities (or the
    softmax of its logits) against the float64 softmax of the reference's logits, the same figures."""
    n = c.n
    sub_probs = c.sub.has("11", "probs")

    def ours(a, b):
        if sub_probs:
            return c.sub.read_rows("11", "probs", a, b, n)
        return softmax64(c.sub.read_rows("8", "logits", a, b, n))

    def theirs(a, b):
        p = softmax64(c.ref.read_rows("8", "logits", a, b, n))
        return p.astype(np.float32) if sub_probs else p
    m, per_row = compare_by_spans(ours, theirs, n)
    row = Row("11", spec.name, None, "probs" if sub_probs else "softmax(cp8.logits)", m, band, within(m, band),
              c.order(2, 0, num))
    c.res.rows.append(row)
    if c.on_disk:
        c.cap_ref.later("cp11.probs", lambda: np.concatenate([theirs(a, min(n, a + SPAN_ROWS)).astype(np.float32)
                                                             for a in range(0, n, SPAN_ROWS)]))
        if sub_probs:
            c.cap_sub.later("cp11.probs", lambda: c.sub.get("11", "probs", None, c.dims))


def _case_greedy(c: _Comparison, spec, band, num):
    if not c.both_hold(spec, "greedy_tokens"):
        return
    a, b = c.sub.raw("12", "greedy_tokens").tolist(), c.ref.raw("12", "greedy_tokens").tolist()
    n = min(len(a), len(b))
    same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), n)
    m = {"shape": [len(a)], "ref_shape": [len(b)], "agreement": same / max(n, 1), "equal_prefix": same, "n": n}
    c.res.greedy = {"n": n, "equal_prefix": same, "ours": a, "reference": b, "ours_text": "", "reference_text": ""}
    gb = greedy_band(band, n)
    row = Row("12", spec.name, None, "greedy_tokens", m, gb, within(m, gb), c.order(3, 99, 0))
    own = c.own_logits()
    if c.local_engine is not None and a and own is not None and c.sub.rows[-1] == len(c.sub.token_ids) - 1:
        _greedy_local(c, row, a, own[-1], same, n)
    c.res.rows.append(row)
    c.cap_sub["cp12.greedy_tokens"], c.cap_ref["cp12.greedy_tokens"] = np.array(a), np.array(b)


def _greedy_local(c: _Comparison, row, a, last_logits, same: int, n: int):
    """Teacher-forced greedy tokens: token 0 is the argmax of the subject's own last prompt logits, token i the
    argmax of its own logits at decode step i where the dump fed tokens 0..i-1 (decode_token_ids) and holds
    that step's logits. The local figure covers those tokens only: it excuses an end-to-end difference only
    where the texts part inside them (a near-tie of the declared arithmetic), never after them."""
    own = [int(last_logits.argmax())]
    fed = c.sub.decode_token_ids
    for k in range(1, len(a)):
        if fed[:k] != a[:k] or not c.sub.has_step_logits(k):
            break
        own.append(int(c.sub.step_view(k).raw("8", "logits").reshape(-1)[-c.cfg.n_vocab:].argmax()))
    agree = sum(x == y for x, y in zip(a, own)) / len(own)
    _token_local(row, {"agreement": agree, "tokens_checked": len(own), "first_token": a[0],
                       "argmax_of_own_logits": own})
    row.local_covers = same >= n or same < len(own)
    if not row.passed and row.local_covers:
        c.res.warnings.append(f"greedy tokens part at token {same} of {n} end to end, where the subject's own logits "
                              f"choose its token (every local check inside its band): a near-tie flip of the "
                              f"declared arithmetic")
    elif not row.passed:
        c.res.warnings.append(f"greedy tokens part at token {same} of {n} end to end, past the {len(own)} token(s) "
                              f"the dump's own logits cover: record decode steps on the greedy tokens "
                              f"(dump --decode-steps) to localize it")


# model-scope checkpoints by id: fn(comparison, spec, band, number) (layer checkpoints are all tensor cases)
_MODEL_CASES = {"0": _case_token_ids, "8": _case_head, "9": _case_head, "10": _case_argmax, "11": _case_probs,
                "12": _case_greedy}


def _token_local(row, m: dict):
    """A token checkpoint's local figure: the subject's tokens against its own logits (exact agreement)."""
    row.local, row.local_band = {"shape": row.metrics.get("shape"), **m}, {"agreement": 1.0}
    row.local_passed = within(row.local, row.local_band)


def subject_getter(engine, sub: Dump, dims: dict):
    """-> get(name, layer): the subject's canonical array as the engine's ops take it (Q/K rows in the engine's
    pair order: NeoX for Gemma or a Hugging Face folder), or None where the subject does not hold it."""
    cat = catalogue()
    where = {name: cp for (cp, name) in cat}

    def get(name, layer):
        cp = where.get(name)
        if cp is None or not sub.has(cp, name, layer):
            return None
        try:
            a = sub.get(cp, name, layer, dims)
        except ValueError:
            return None
        if list(a.shape) != expected_shape(cat[(cp, name)], dims):
            return None
        return neox_pairs(a, dims["R"]) if neox_rows(engine, cp, name) else a
    return get


def neox_rows(engine, cp, name) -> bool:
    """Whether the engine's ops hold this tensor's Q/K rows in NeoX pair order (its outputs then come back to
    the canonical adjacent order)."""
    return getattr(engine, "qk_rows", "adjacent") == "neox" and bool(catalogue()[(cp, name)].get("rope_pairs"))


def fused_attention(sub: Dump) -> bool:
    """The subject declares llama.cpp's flash attention (attn_out then checked through its emulation)."""
    return bool(((sub.arithmetic or {}).get("settings") or {}).get("flash_attn"))


def one_token_rows(sub: Dump) -> list | None:
    """Per row the subject holds, whether llama.cpp computed it in a micro-batch of one token (then by its
    vec_dot, not by tinyBLAS's tiles): from the dump's arithmetic settings batch_tokens ({"prompt": the size of the
    micro-batch of each prompt token, "decode": the tokens of each decode step's batch}), else from its
    n_ubatch (a prompt cut into micro-batches of n_ubatch tokens, one token a decode step). None for a
    dump not in ggml numerics."""
    ar = sub.arithmetic or {}
    if ar.get("numerics") != "ggml":
        return None
    sizes = (ar.get("settings") or {}).get("batch_tokens") or {}
    if sub.past_token_ids:
        return [int(sizes.get("decode", 1)) == 1] * len(sub.rows)
    t = len(sub.token_ids)
    per = sizes.get("prompt")
    if per is None:
        u = int((ar.get("settings") or {}).get("n_ubatch") or t)
        per = [min(u, t - (i // u) * u) for i in range(t)]
    return [int(per[r]) == 1 for r in sub.rows]


class _LocalReader:
    """local(cp, tensor, layer): the engine's op on the subject's inputs, or None (inputs not held). A layer's
    outputs are computed once, on first use, and kept until forget(layer) (the comparison runs layer by layer:
    one layer's at a time)."""

    def __init__(self, engine, sub: Dump, cat: dict, dims: dict, positions, score_index=None):
        """score_index: the rows (indices into the rows held) at which the subject holds its attention scores,
        where it samples them (the local attention then keeps those rows' scores alone)."""
        self.engine, self.sub, self.cat, self.dims, self.positions = engine, sub, cat, dims, positions
        self.score_index = score_index
        self.memo = {}
        self.get = subject_getter(engine, sub, dims)

    def forget(self, layer):
        self.memo.pop(layer, None)

    def __call__(self, cp, tensor, layer):
        engine, sub, get = self.engine, self.sub, self.get
        key = ("head9" if cp == "9" else "head") if layer is None else layer
        if key not in self.memo:
            self.memo[key] = (model_outputs(engine, last_row(get) if cp == "9" else get) if layer is None else
                              local_outputs(engine, get, layer, [sub.token_ids[r] for r in sub.rows],
                                            fused_attention=fused_attention(sub), past=len(sub.past_token_ids),
                                            positions=self.positions, one_token=one_token_rows(sub),
                                            cells=((sub.arithmetic or {}).get("settings") or {}).get("cells"),
                                            score_rows=self.score_index))
        lo = self.memo[key].get(tensor)
        if cp == "9" and lo is not None:            # the last row alone, from the subject's own result_norm
            return lo[-1]                           # (computed on that row alone: see local.last_row)
        if lo is not None and neox_rows(engine, cp, tensor):
            lo = to_canonical(lo, self.cat[(cp, tensor)], {"rope_pairs": "neox"}, self.dims)
        return lo


def _argmax(d: Dump):
    if d.has("10", "argmax"):
        return d.raw("10", "argmax").astype(np.int64), "argmax"
    if d.has("8", "logits"):
        n = len(d.rows)
        return np.concatenate([d.read_rows("8", "logits", a, min(n, a + SPAN_ROWS), n).argmax(-1)
                               for a in range(0, n, SPAN_ROWS)]), "argmax(cp8.logits)"
    return None, None


def _probs(d: Dump, dims, float64=False):
    if d.has("11", "probs") and not float64:
        return d.get("11", "probs", None, dims), "probs"
    if d.has("8", "logits"):
        return softmax64(d.get("8", "logits", None, dims)), "softmax(cp8.logits)"
    if d.has("11", "probs"):
        return d.get("11", "probs", None, dims), "probs"
    return None, None



SPAN_BYTES = 16 * 2**20      # a model tensor [T, X] larger than this is compared a span of rows at a time
SPAN_ROWS = 256


class LazyCaptures(dict):
    """The captures of a comparison whose dumps lie on disk: key -> array, read again each time it is asked for
    (a bundle's writer, the HTML report), never held. later(key, read) registers one; plain items too."""

    def later(self, key, read):
        super().__setitem__(key, _Later(read))

    def __getitem__(self, key):
        v = super().__getitem__(key)
        return v.read() if isinstance(v, _Later) else v

    def __iter__(self):
        return iter(self.keys())

    def get(self, key, default=None):
        return self[key] if key in self else default

    def items(self):
        return [(k, self[k]) for k in self.keys()]

    def values(self):
        return [self[k] for k in self.keys()]


class _Later:
    def __init__(self, read):
        self.read = read


def compare_by_spans(read_ours, read_ref, n: int, span: int = SPAN_ROWS) -> tuple[dict, list]:
    """metrics.compare of two [n, X] tensors, read a span of rows at a time (read(a, b) -> rows a..b-1), without
    either whole in memory: the same figures (sums in float64, added span by span), and each row's NMSE. ->
    (figures, per-row NMSE)."""
    peak_ref, spans = 0.0, range(0, n, span)
    for a in spans:
        b = np.asarray(read_ref(a, min(n, a + span)), dtype=np.float64)
        fin = b[np.isfinite(b)]
        peak_ref = max(peak_ref, float(np.max(np.abs(fin))) if fin.size else 0.0)
    floor = max(1e-3 * peak_ref, 1e-12)
    sq = den = dot = na = nb = 0.0
    max_abs = max_rel = 0.0
    per_row, shape, any_diff = [], None, False
    for a in spans:
        x = np.asarray(read_ours(a, min(n, a + span)), dtype=np.float64)
        y = np.asarray(read_ref(a, min(n, a + span)), dtype=np.float64)
        shape = [n, x.shape[1]]
        if x.shape != y.shape:
            return ({"shape": list(x.shape), "ref_shape": list(y.shape), "max_abs": math.inf, "max_rel": math.inf,
                     "nmse": math.inf, "cosine": float("nan"), "error": f"shape {x.shape} != reference {y.shape}"},
                    [math.inf] * n)
        per_row += nmse_by_row(x, y, 0)
        fin = np.isfinite(x) & np.isfinite(y)
        if not fin.all():
            if not np.array_equal(x[~fin], y[~fin], equal_nan=True):
                return ({"shape": shape, "max_abs": math.inf, "max_rel": math.inf, "nmse": math.inf,
                         "cosine": float("nan"), "error": "non-finite values differ"}, [math.inf] * n)
            x, y = x[fin], y[fin]
        d = x - y
        absd = np.abs(d)
        any_diff = any_diff or bool(d.any())
        if d.size:
            max_abs = max(max_abs, float(absd.max()))
            max_rel = max(max_rel, float((absd / np.maximum(np.abs(y), floor)).max()))
        sq, den = sq + float(np.sum(d * d)), den + float(np.sum(y * y))
        dot, na, nb = dot + float(np.dot(x.ravel(), y.ravel())), na + float(np.sum(x * x)), nb + float(np.sum(y * y))
    na, nb = math.sqrt(na), math.sqrt(nb)
    return ({"shape": shape, "max_abs": max_abs, "max_rel": max_rel,
             "nmse": sq / den if den > 0 else (0.0 if not any_diff else math.inf),
             "cosine": 1.0 if not any_diff else (dot / (na * nb) if na > 0 and nb > 0 else 0.0),
             "by_spans": span}, per_row)


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
