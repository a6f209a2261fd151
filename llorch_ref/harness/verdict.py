"""The verdict of one comparison: one object, computed by one function (`judge`), that every face renders
(diff and prove's terminal output and exit code, result.json, report.html, summary.md, junit.xml, the pytest
plugin, the Python API, verify).

The rule, in order:

1. FAIL when any comparison diverges: outside its band by its local (teacher-forced) error where that local
   figure covered everything the operation read, else by its end-to-end error (Row.diverges).
2. INCOMPLETE when no comparison was made, or when a required tensor was not compared on every layer of the
   prompt's forward, or a decode step the subject declares holds nothing comparable. Not covered is never
   passed. What is required is chosen by `require`: "auto" (the default) asks for every checkpoint tensor both
   sides' engine kinds can provide but the optional greedy text (checkpoints/coverage.json; a subject of a kind
   it does not list: every tensor),
   "all" for every tensor of the model, or a list of checkpoint ids, names or cp<id>.<tensor> keys.
3. PASS otherwise.

Exit codes: PASS 0, FAIL 1, INCOMPLETE 3 (2 stays bad input).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from ..checkpoints import catalogue_path, token_checkpoints
from ..errors import ParameterError

PASS, FAIL, INCOMPLETE = "PASS", "FAIL", "INCOMPLETE"
EXIT_CODES = {PASS: 0, FAIL: 1, INCOMPLETE: 3}


@dataclass(frozen=True)
class Verdict:
    status: str                          # PASS | FAIL | INCOMPLETE
    first_divergence: dict | None        # {"checkpoint", "layer", "tensor", "step", "by"} or None
    compared: int                        # comparisons made (rows)
    diverging: int                       # of them outside their band (Row.diverges)
    not_covered: int                     # comparisons the subject or the reference could not give
    required: list = field(default_factory=list)     # the coverage keys required (cp<id>.<tensor> or cp<id>)
    missing: list = field(default_factory=list)      # required keys not compared everywhere
    rule: str = ""                       # how `required` was chosen, in words
    band_class: str = ""
    local_declaration: str | None = None
    reasons: list = field(default_factory=list)      # why the status is not PASS, one line each

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.status]

    @property
    def passed(self) -> bool:
        return self.status == PASS

    def coverage_line(self) -> str:
        have = len(self.required) - len(self.missing)
        return (f"coverage: {have} of {len(self.required)} required tensors compared on every layer ({self.rule}); "
                f"{self.compared} comparisons, {self.not_covered} not covered")

    def line(self) -> str:
        """The verdict in one line, as every face prints it."""
        if self.status == PASS:
            have = len(self.required) - len(self.missing)
            return (f"verdict: PASS ({self.compared} comparisons inside their bands; {have} of {len(self.required)} "
                    f"required tensors compared)")
        return f"verdict: {self.status} ({'; '.join(self.reasons)})"

    def to_json(self) -> dict:
        return {**asdict(self), "exit_code": self.exit_code}


def coverage_key(checkpoint: str, tensor: str) -> str:
    """The unit of coverage: cp<id>.<tensor> for tensors, cp<id> for the token checkpoints (compared once
    under a name that says how they were derived, e.g. argmax(cp8.logits))."""
    return f"cp{checkpoint}" if checkpoint in token_checkpoints() else f"cp{checkpoint}.{tensor.split('@')[0]}"


def every_key(specs, cfg) -> list[str]:
    """Every coverage key of these checkpoints for this model."""
    keys = []
    for s in specs:
        if s.token_checkpoint:
            keys.append(f"cp{s.id}")
        elif s.scope == "layer":
            keys += [f"cp{s.id}.{t.ours}" for t in s.tensors_for(cfg)]
        else:
            keys += [f"cp{s.id}.{d['name']}" for d in s.dump]
    return keys


def _coverage() -> dict:
    return json.loads((catalogue_path() / "coverage.json").read_text())


def _engine_kinds() -> dict:
    return _coverage()["engines"]


def _kind_lacks(manifest: dict) -> tuple[set | None, str]:
    """-> (the coverage keys this side's engine kind cannot provide, or None for a kind not listed; its name,
    with its flash attention where that matters)."""
    name = str((manifest.get("engine") or {}).get("name", ""))
    kind = _engine_kinds().get(name)
    if kind is None:
        return None, name or "an unnamed engine"
    flash = bool(((manifest.get("arithmetic") or {}).get("settings") or {}).get("flash_attn"))
    lacks = set(kind.get("lacks", [])) | (set(kind.get("lacks_with_flash_attn", [])) if flash else set())
    return lacks, name + (" with flash attention" if flash else "")


def required_keys(require, specs, cfg, sides: dict) -> tuple[list[str], str]:
    """-> (the coverage keys required, the rule in words). require: None/"auto" (what both sides' engine
    kinds can provide: a subject of a kind not listed owes every tensor), "all", or ids, names and
    cp<id>.<tensor> keys (a list or a comma-separated string). sides: {"subject", "reference"} manifests."""
    keys = every_key(specs, cfg)
    if require in (None, "auto"):
        optional = set(_coverage().get("optional", []))
        sub, sub_name = _kind_lacks(sides.get("subject") or {})
        if sub is None:
            return ([k for k in keys if k not in optional],
                    f"every tensor but the greedy text: {sub_name} is not an engine kind whose gaps are known")
        ref, ref_name = _kind_lacks(sides.get("reference") or {})
        lacks = sub | (ref or set()) | optional
        what = f"what {sub_name} provides" + (f" and {ref_name} compares" if ref else "")
        return [k for k in keys if k not in lacks], what
    if require == "all":
        return keys, "every tensor (--require all)"
    items = [i.strip() for i in (require.split(",") if isinstance(require, str) else require) if str(i).strip()]
    by_id = {s.id: s for s in specs} | {s.name: s for s in specs}
    out = []
    for i in items:
        i = str(i)
        spec = by_id.get(i[2:] if i.startswith("cp") and i[2:] in by_id else i)
        if spec is not None:
            out += [k for k in keys if k == f"cp{spec.id}" or k.startswith(f"cp{spec.id}.")]
        elif i in keys:
            out.append(i)
        else:
            raise ParameterError(f"--require {i}: not a checkpoint id, name or cp<id>.<tensor> of this model "
                                 f"(e.g. 3, kv_cache, cp4.kq; or all, auto)")
    return list(dict.fromkeys(out)), f"--require {','.join(items)}"


def judge(res, require=None) -> Verdict:
    """The verdict of a DiffResult (rule in the module docstring). `require` as in required_keys; None takes
    the one the run recorded (res.require)."""
    require = res.require if require is None else require
    required, rule = required_keys(require, res.specs, res.config, res.sides) \
        if res.config is not None else ([], "not known")
    return verdict_of(res, [k for k in required if k not in res.not_applicable], rule)


def verdict_of(res, required: list, rule: str) -> Verdict:
    """The rule itself, on a result's rows, not-covered entries and first divergence, against the required
    coverage keys (judge derives them from the model; verify reads them from a bundle)."""
    rows, nc, fd = res.rows, res.not_covered, res.first_divergence
    diverging = sum(r.diverges for r in rows)
    missing = _missing(required, rows, nc)
    reasons = []
    if fd is not None:
        reasons.append(f"{diverging} of {len(rows)} comparisons outside their bands; first divergence: checkpoint "
                       f"{fd['checkpoint']}, layer {fd['layer']}, tensor {fd['tensor']}, step {fd['step']} "
                       f"(by {fd['by']})")
    if not rows:
        reasons.append("nothing was compared (not covered is not passed)")
    if missing:
        reasons.append(f"{len(missing)} of {len(required)} required tensors not compared on every layer "
                       f"({rule}): {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")
    empty_steps = sorted({str(u.get("tensor")) for u in nc if u.get("checkpoint") == "steps"})
    if empty_steps:
        reasons.append(f"decode step(s) {', '.join(empty_steps)} declared but not held")
    status = FAIL if fd is not None else (INCOMPLETE if reasons else PASS)
    return Verdict(status=status, first_divergence=fd, compared=len(rows), diverging=diverging,
                   not_covered=len(nc), required=list(required), missing=missing, rule=rule,
                   band_class=str(res.band_class), local_declaration=res.local_declaration, reasons=reasons)


def _missing(required, rows, not_covered) -> list[str]:
    """Required keys with no comparison, or with a case of the prompt's forward not covered."""
    seen = {coverage_key(r.checkpoint, r.tensor) for r in rows if r.step == 0}
    gaps = {coverage_key(u["checkpoint"], u["tensor"]) for u in not_covered
            if u["checkpoint"] != "steps" and "@step" not in str(u["tensor"])}
    return [k for k in required if k not in seen or k in gaps]
