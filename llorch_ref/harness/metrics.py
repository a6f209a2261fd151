"""Raw figures for every comparison. Nothing here decides 'identical': a band does, and both are printed."""
from __future__ import annotations

import math

import numpy as np


def nmse_by_row(ours, ref, axis: int) -> list:
    """NMSE of each index along `axis` (a row of the forward: one position), the other axes summed; float64.
    Non-finite rows count as infinite error."""
    a = np.moveaxis(np.asarray(ours, dtype=np.float64), axis, 0).reshape(np.shape(ours)[axis], -1)
    b = np.moveaxis(np.asarray(ref, dtype=np.float64), axis, 0).reshape(a.shape[0], -1)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        num, den = np.sum((a - b) ** 2, axis=1), np.sum(b * b, axis=1)
        out = np.where(den > 0, num / np.where(den > 0, den, 1), np.where(num > 0, np.inf, 0.0))
    return [float(x) if np.isfinite(x) else math.inf for x in out]


def compare(ours, ref) -> dict:
    """ours, ref: arrays of the same intended shape -> {shape, max_abs, max_rel, nmse, cosine}.

    max_rel uses a floored denominator: |a-b| / max(|b|, 1e-3 * max|b|, 1e-12), so near-zero entries of the
    reference do not blow it up. NMSE = sum((a-b)^2) / sum(b^2), the convention of llama.cpp's
    test-backend-ops. All sums in float64.
    """
    a = np.asarray(ours, dtype=np.float64)
    b = np.asarray(ref, dtype=np.float64)
    if a.shape != b.shape:
        return {"shape": list(a.shape), "ref_shape": list(b.shape), "max_abs": math.inf, "max_rel": math.inf,
                "nmse": math.inf, "cosine": float("nan"), "error": f"shape {a.shape} != reference {b.shape}"}
    finite = np.isfinite(a) & np.isfinite(b)
    if not finite.all():
        same_nonfinite = np.array_equal(a[~finite], b[~finite], equal_nan=True)
        if not same_nonfinite:
            return {"shape": list(a.shape), "max_abs": math.inf, "max_rel": math.inf, "nmse": math.inf,
                    "cosine": float("nan"), "error": "non-finite values differ"}
        a, b = a[finite], b[finite]
    d = a - b
    absd = np.abs(d)
    identical = not d.any()
    floor = max(1e-3 * float(np.max(np.abs(b))) if b.size else 0.0, 1e-12)
    den = float(np.sum(b * b))
    na, nb = float(np.linalg.norm(a)), float(np.linalg.norm(b))
    return {
        "shape": list(np.shape(ours)),
        "max_abs": float(absd.max()) if d.size else 0.0,
        "max_rel": float((absd / np.maximum(np.abs(b), floor)).max()) if d.size else 0.0,
        "nmse": float(np.sum(d * d) / den) if den > 0 else (0.0 if not d.any() else math.inf),
        "cosine": 1.0 if identical else (float(np.dot(a.ravel(), b.ravel()) / (na * nb)) if na > 0 and nb > 0
                                         else 0.0),
    }


def within(m: dict, band: dict) -> bool:
    """A band is a dict of upper limits (nmse, max_abs) and lower limits (cosine, agreement, equal_prefix)."""
    if m.get("error"):
        return False
    for k, lim in band.items():
        v = m.get(k)
        if v is None or (isinstance(v, float) and math.isnan(v)):
            return False
        if k in ("cosine", "agreement", "equal_prefix"):
            if v < lim:
                return False
        elif v > lim:
            return False
    return True


def fmt(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        if math.isinf(x) or math.isnan(x):
            return str(x)
        if x == 0:
            return "0"
        return f"{x:.3e}" if abs(x) < 1e-3 or abs(x) >= 1e4 else f"{x:.6g}"
    return str(x)


def fmt_cos(x) -> str:
    """Cosine similarity near 1 printed as 1-d, so 0.999999999997 does not read as 1."""
    if isinstance(x, float) and 0.99 < x < 1.0:
        return f"1-{1.0 - x:.2e}"
    return fmt(x)


def fmt_match(summary: dict) -> str:
    """The similarity column of a checkpoint summary: cosine, or agreement / equal prefix for token checks."""
    if summary.get("min_cosine") is not None:
        return fmt_cos(summary["min_cosine"])
    if summary.get("equal_prefix") is not None:
        return f"{summary['equal_prefix']} tokens equal"
    if summary.get("min_agreement") is not None:
        return f"agreement {summary['min_agreement']:.3f}"
    return "-"


def fmt_row_match(m: dict, band: dict | None = None) -> str:
    """The similarity of one comparison, said for what it is: a cosine; an equal prefix of n tokens (the greedy
    text, with the prefix its band asks for); or an agreement fraction (argmax, token ids)."""
    if m.get("cosine") is not None:
        return fmt_cos(m["cosine"])
    if m.get("equal_prefix") is not None:
        asked = (band or {}).get("equal_prefix")
        return f"{m['equal_prefix']}/{m.get('n', '?')} tokens equal" + (f" (band: first {asked})" if asked else "")
    if m.get("agreement") is not None:
        return f"agreement {m['agreement']:.3f}"
    return "-"


def summary_markdown(summary: list[dict]) -> list[str]:
    """Markdown lines of a checkpoint summary (DiffResult.summary()): one row per checkpoint, the worst
    figures over its layers and tensors, where the worst sits, the band that applied there, the verdict."""
    lines = ["| checkpoint | name | comparisons | worst NMSE | worst max abs | min cosine / agreement | worst at | "
             "band | verdict |", "|---|---|---|---|---|---|---|---|---|"]
    for s in summary:
        at = s["worst_at"]
        verdict = "not covered" if s["passed"] is None else ("pass" if s["passed"] else "FAIL")
        if s.get("not_covered") and s["passed"] is not None:
            verdict += f" ({s['not_covered']} not covered: {s['why']})"
        lines.append(f"| {s['checkpoint']} | {s['name']} | {s['rows']} | {fmt(s['worst_nmse'])} | "
                     f"{fmt(s['worst_max_abs'])} | {fmt_match(s) if s['passed'] is not None else 'n/c'} | "
                     f"{'' if at['layer'] is None else 'L' + str(at['layer']) + ' '}{at['tensor']} | "
                     f"`{s['band']}` | {verdict} |")
    return lines
