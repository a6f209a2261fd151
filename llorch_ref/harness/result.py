"""The result of one comparison: a row per compared tensor (end-to-end and, where measured, local figures),
what was not covered and why, and the summaries the faces print."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..dump import CANONICAL_LAYOUTS, Dump
from .verdict import judge


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
    local_covers: bool = True          # the local figure covered everything the operation read (else it excuses nothing)
    step: int = 0                      # 0: the prompt's forward; K: the K-th decode step
    by_position: dict | None = None    # {"nmse": [per row held], "local_nmse"?: [...]} (the prompt's forward)

    @property
    def diverges(self) -> bool:
        """Where a local figure exists and covered everything the operation read, it decides (the end-to-end
        error may be inherited); a failed local figure always diverges; else the end-to-end one decides."""
        if self.local_passed is False:
            return True
        if self.local_passed and self.local_covers:
            return False
        return not self.passed


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
    sides: dict = field(default_factory=dict)            # {"subject", "reference"}: each side's dump manifest
    greedy: dict = field(default_factory=dict)
    timings: dict = field(default_factory=dict)
    specs: list = field(default_factory=list)
    subject_label: str = "llorch-ref"
    reference_label: str = "llama.cpp"
    not_covered: list = field(default_factory=list)      # [{checkpoint, name, layer, tensor, why}]
    warnings: list = field(default_factory=list)         # lines a reader must see (e.g. different model files)
    local_declaration: str | None = None                 # the arithmetic of the local comparison, when one ran
    positions: list = field(default_factory=list)        # the absolute position of each row of the forward held
    recipe: dict = field(default_factory=dict)            # how to run the reference side again (harness/rerun.py)
    config: object = None                                # the model's Config (what coverage is counted against)
    require: object = "auto"                             # what the verdict requires covered (harness/verdict.py)
    not_applicable: list = field(default_factory=list)    # coverage keys this model cannot have (cp0 without a vocabulary)

    def verdict(self, require=None):
        """The one verdict of this comparison (harness/verdict.py: judge), which every face renders."""
        return judge(self, require)

    @property
    def first_divergence(self):
        """The first row in forward order that diverges: by its local (teacher-forced) error where the
        comparison has one, else by its end-to-end error."""
        bad = [r for r in self.rows if r.diverges]
        if not bad:
            return None
        r = min(bad, key=lambda r: r.order)
        out = {"checkpoint": r.checkpoint, "layer": r.layer, "tensor": r.tensor, "step": r.step,
               "by": "local error" if r.local_passed is False else "end-to-end error"}
        if (r.local or {}).get("bad_positions"):
            out["positions"] = r.local["bad_positions"]         # the cache rows at fault
        return out

    def subject_dump(self):
        """The subject's tensors this comparison held, as a Dump in the canonical layout (its manifest's token ids,
        rows and decode steps): what a bundle keeps of it, and what repro and verify read."""
        man = {**self.sides["subject"], "layouts": dict(CANONICAL_LAYOUTS)}
        return Dump(manifest=man, tensors=dict(self.captures_ours), source=f"{self.subject_label} (as compared)")

    def passed(self, checkpoint=None) -> bool:
        """The whole run: its verdict is PASS (nothing diverges and the required coverage is met). One
        checkpoint: it was compared and none of its rows diverges."""
        if checkpoint is None:
            return self.verdict().passed
        rows = [r for r in self.rows if r.checkpoint == checkpoint]
        return bool(rows) and not any(r.diverges for r in rows)

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
            worst = max(rows, key=lambda r: (r.diverges, not r.passed, r.metrics.get("nmse", 0.0)))
            # token checkpoints have agreement figures instead of tensor metrics
            out.append({
                "checkpoint": spec.id, "name": spec.name, "rows": len(rows),
                "failed": sum(r.diverges for r in rows),      # by the verdict's rule (Row.diverges)
                "failed_end_to_end": sum(not r.passed for r in rows),
                "worst_nmse": max((r.metrics["nmse"] for r in rows if "nmse" in r.metrics), default=None),
                "worst_max_abs": max((r.metrics["max_abs"] for r in rows if "max_abs" in r.metrics), default=None),
                "min_cosine": min((r.metrics["cosine"] for r in rows if "cosine" in r.metrics), default=None),
                "min_agreement": min((r.metrics["agreement"] for r in rows if "agreement" in r.metrics),
                                     default=None),
                "equal_prefix": min((r.metrics["equal_prefix"] for r in rows if "equal_prefix" in r.metrics),
                                    default=None),
                "worst_at": {"layer": worst.layer, "tensor": worst.tensor},
                "band": worst.band, "passed": not any(r.diverges for r in rows),     # the band at the worst row
                "not_covered": len(missing), "why": missing[0]["why"] if missing else None,
            })
        return out

    def by_position(self) -> dict:
        """Error by position over the prompt's forward: for each row held (its absolute position), the worst
        NMSE over every tensor and layer, end to end and local, with where it is; and per tensor name, the
        worst over layers (the series a plot draws)."""
        rows = [r for r in self.rows if r.by_position]
        out = {"positions": self.positions, "worst_nmse": [], "worst_at": [], "worst_local_nmse": [],
               "local_worst_at": [], "by_tensor": {}, "local_by_tensor": {}}
        for key, at, per in (("worst_nmse", "worst_at", "by_tensor"),
                             ("worst_local_nmse", "local_worst_at", "local_by_tensor")):
            fig = "nmse" if key == "worst_nmse" else "local_nmse"
            have = [r for r in rows if fig in r.by_position]
            for i in range(len(self.positions) if have else 0):      # None: a row not held (sampled scores)
                r = max(have, key=lambda r: -1.0 if r.by_position[fig][i] is None else r.by_position[fig][i])
                out[key].append(r.by_position[fig][i] or 0.0)
                out[at].append(f"cp{r.checkpoint} {r.tensor}" + (f" L{r.layer}" if r.layer is not None else ""))
            for r in have:
                cur = out[per].setdefault(r.tensor, [0.0] * len(self.positions))
                out[per][r.tensor] = [a if b is None else max(a, b) for a, b in zip(cur, r.by_position[fig])]
        return out

    def to_json(self) -> dict:
        return {
            "model": self.model, "reference_model": self.reference_model, "prompt": self.prompt,
            "token_ids": self.token_ids, "band_class": self.band_class,
            "verdict": self.verdict().to_json(), "first_divergence": self.first_divergence,
            "passed": self.passed(),
            "summary": self.summary(), "greedy": self.greedy, "timings": self.timings,
            "sides": self.sides, "subject": self.subject_label,
            "reference": self.reference_label, "not_covered": self.not_covered, "warnings": self.warnings,
            "local_declaration": self.local_declaration, "by_position": self.by_position(), "recipe": self.recipe,
            "rows": [{"checkpoint": r.checkpoint, "name": r.name, "layer": r.layer, "tensor": r.tensor, "step": r.step,
                      **r.metrics, "band": r.band, "passed": r.passed,
                      "diverges": r.diverges,
                      **({"local": r.local, "local_band": r.local_band, "local_passed": r.local_passed,
                          "local_covers": r.local_covers}
                         if r.local is not None else {})} for r in self.rows],
        }
