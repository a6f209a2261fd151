"""report.html: one self-contained page per run (inline SVG and PNG, no script, no network): the verdict; a
card for the first divergence (operation, layer, step, local and inherited error, a heat map of |difference|
over tokens x channels, the worst indices, the operation's inputs); one row per checkpoint; error by layer of
every layer checkpoint with the layer kinds marked; the greedy text; settings and versions. The same page
shows a corpus evaluation's statistics and KLD plots (`render_eval`). Rendered by jinja2 from
templates/report.html.j2."""
from __future__ import annotations

import json

import numpy as np

from ..dump import catalogue, token_axis
from . import plots
from .local import INPUTS
from .metrics import fmt, fmt_cos, fmt_match, fmt_row_match


def _template():
    import jinja2
    env = jinja2.Environment(loader=jinja2.PackageLoader("llorch_ref.harness", "templates"),
                             autoescape=jinja2.select_autoescape(["html", "j2"]), trim_blocks=True, lstrip_blocks=True)
    env.filters.update(fmt=fmt, fmt_cos=fmt_cos, json=lambda x: json.dumps(x))
    return env.get_template("report.html.j2")


def layer_figure(spec, rows, local_layers=None, figsize=(7, 3.2)):
    """Error by layer of one layer checkpoint (the prompt's forward): NMSE end to end per tensor, local where
    measured, the band, local (sliding-window) layers shaded."""
    rows = [r for r in rows if r.step == 0 and r.layer is not None and "nmse" in r.metrics]
    series, local = {}, {}
    for r in rows:
        s = series.setdefault(r.tensor, ([], []))
        s[0].append(r.layer)
        s[1].append(r.metrics["nmse"])
        if r.local is not None and "nmse" in r.local:
            lo = local.setdefault(r.tensor, ([], []))
            lo[0].append(r.layer)
            lo[1].append(r.local["nmse"])
    band = rows[0].band.get("nmse") if rows else None
    return plots.error_by_layer(f"checkpoint {spec.id}: {spec.title}", series, band, local_layers, local, figsize)


def _layer_kinds(ll) -> str:
    if not ll:
        return "every layer attends globally (full causal attention)"
    loc = [i for i, v in enumerate(ll) if v]
    return (f"{len(loc)} local (sliding-window) layers, shaded in the plots; global layers: "
            f"{', '.join(str(i) for i, v in enumerate(ll) if not v)}")


def _as_rows_by_channels(a, entry):
    """A canonical tensor -> [rows held, channels]: the token axis first, the rest flattened."""
    a = np.asarray(a, dtype=np.float64)
    ax = token_axis(entry)
    if a.ndim == 1:
        return a[None, :], "row", "channel"
    if ax is None:
        return a.reshape(a.shape[0], -1), entry["shape"].split(",")[0], "channel"
    dims = entry["shape"].split(",")
    rest = [d for i, d in enumerate(dims) if i != ax]
    return np.moveaxis(a, ax, 0).reshape(a.shape[ax], -1), "token (row held)", " x ".join(rest)


def divergence_card(result, case, plot: bool) -> dict | None:
    """What the first-divergence card shows: where, how (local or end to end), the figures, the inherited error
    (the worst end-to-end NMSE of the operation's inputs), the inputs, the worst indices and a heat map."""
    fd = result.first_divergence
    if fd is None:
        return None
    row = min((r for r in result.rows if r.diverges), key=lambda r: r.order)
    tensor = row.tensor.split("@")[0]
    key = f"cp{row.checkpoint}.{tensor}" + ("" if row.layer is None else f".layer{row.layer}") \
        + (f".step{row.step}" if row.step else "")
    s = (case or {}).get("subject_output")
    ref = (case or {}).get("reference_output")
    how = "the subject's output against the reference's operation on the subject's own inputs (local)"
    if s is None or ref is None:
        s, ref = result.captures_ours.get(key), result.captures_ref.get(key)
        how = "the subject's output against the reference's output (end to end)"
    inputs = []
    for name in INPUTS.get(tensor, ()):
        for word in name.replace(",", " ").replace("(", " ").replace(")", " ").split():
            lay = row.layer - 1 if word.startswith("l_out[L-1]") else row.layer
            word = word.split("[")[0]
            r = next((r for r in result.rows if r.tensor.split("@")[0] == word and r.layer == lay
                      and r.step == row.step), None)
            if r is not None and all(i["tensor"] != word or i["layer"] != lay for i in inputs):
                inputs.append({"tensor": word, "layer": lay, "nmse": r.metrics.get("nmse"),
                               "local": (r.local or {}).get("nmse"), "passed": not r.diverges})
    card = {"fd": fd, "row": row, "tensor": tensor, "how": how, "end": row.metrics, "local": row.local,
            "local_band": row.local_band, "band": row.band, "inputs": inputs, "case": case,
            "inherited": max((i["nmse"] for i in inputs if i["nmse"] is not None), default=None),
            "worst": [], "heatmap": None, "match": fmt_row_match(row.metrics, row.band)}
    if s is not None and ref is not None and np.shape(s) == np.shape(ref) and np.size(s):
        entry = catalogue()[(row.checkpoint, tensor)]
        d = np.abs(np.asarray(s, np.float64) - np.asarray(ref, np.float64))
        order = np.argsort(d, axis=None)[::-1][:8]
        names = entry["shape"].split(",")
        for flat in order:
            idx = np.unravel_index(flat, d.shape)
            card["worst"].append({"index": ", ".join(f"{n}={int(i)}" for n, i in zip(names, idx)),
                                  "subject": float(np.asarray(s)[idx]), "reference": float(np.asarray(ref)[idx]),
                                  "diff": float(d[idx])})
        if plot:
            grid, ylab, xlab = _as_rows_by_channels(d, entry)
            card["heatmap"] = plots.png(plots.heatmap(grid, f"|difference| of {tensor}"
                                                      + ("" if row.layer is None else f", layer {row.layer}"),
                                                      xlabel=xlab, ylabel=ylab))
    return card


def render(result, man, run_id, engine, case, plot=True, layer_svgs=None, plot_off=None) -> str:
    """The run's page; case: repro.write's answer (with the operation's outputs) or None; layer_svgs:
    {checkpoint id: its error-by-layer figure as SVG} (the bundle draws each once); plot_off: why no plots were
    drawn where that was asked (else, without plots, the page says matplotlib is missing)."""
    figures = [{"id": s.id, "title": s.title, "svg": layer_svgs[s.id]} for s in result.specs
               if s.id in (layer_svgs or {})]
    summary = []
    for s in result.summary():
        rows = [r for r in result.rows if r.checkpoint == s["checkpoint"]]
        bad = [r for r in rows if r.diverges]
        summary.append({**s, "match": fmt_match(s) if s["passed"] is not None else "-",
                        "diverges": bool(bad), "local_failed": sum(r.local_passed is False for r in rows),
                        "has_local": any(r.local_passed is not None for r in rows)})
    greedy = result.greedy or None
    band12 = next((r.band for r in result.rows if r.checkpoint == "12"), {})
    settings = {k: v for k, v in man.items() if k not in ("sides", "files", "token_ids", "recipe", "weights")}
    return _template().render(
        title=f"llorch-ref proof run {run_id}", run_id=run_id, result=result, man=man, summary=summary,
        card=divergence_card(result, case, plot), figures=figures, plot=plot, plot_off=plot_off, greedy=greedy,
        band12=band12,
        layer_kinds=_layer_kinds(man.get("local_layers")), settings=settings, sides=man.get("sides", {}),
        eval=None, repro=case)


def render_eval(out: dict, plot=True) -> str:
    """The page of a corpus evaluation (EvalResult.to_json()): the statistics, KLD by position, the histogram."""
    figs = []
    if plot and plots.available():
        figs = [{"title": "mean KLD by position in the chunk", "svg": plots.svg(plots.kld_by_position(out))},
                {"title": "KLD per scored token", "svg": plots.svg(plots.kld_histogram(out))}]
    return _template().render(title=f"llorch-ref eval: {out['subject']} vs {out['reference']}", run_id=None,
                              result=None, eval=out, eval_figures=figs, plot=plot, man=None, card=None, figures=[])
