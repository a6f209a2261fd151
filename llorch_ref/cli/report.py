"""What the comparison commands print: the table of checkpoints, every comparison (-v), the greedy text,
what was not covered, warnings and the first divergence with its figures."""
from __future__ import annotations

import json
import sys

from rich import box
from rich.console import Console
from rich.table import Table

from ..harness.metrics import fmt, fmt_cos, fmt_match, fmt_row_match
from ..harness.text_safety import for_terminal
from .common import log


def report_generation(res):
    n = len(res.token_ids)
    rate = f", {n / res.decode_s:.1f} tokens/s" if res.decode_s > 0 and n else ""
    stop = res.stop_reason + (f" {res.stop_sequence!r}" if res.stop_sequence else "")
    log(f"llorch-ref: {len(res.prompt_ids)} prompt tokens in {res.prefill_s:.2f} s; {n} generated{rate}; "
         f"stop: {stop}; seed {res.seed}")


def print_result(res, verbose, file=None):
    """The comparison as a person reads it: one row per checkpoint (and per comparison with verbose), the
    greedy text, what was not covered, warnings, the first divergence with its figures."""
    con = console_for(file)
    ref_name = "the numpy backend" if res.band_class.startswith("backend:") else res.reference_label
    con.print(_summary_table(res, ref_name))
    if res.local_declaration is not None:
        con.print(_local_table(res))
    if verbose:
        con.print(_every_comparison(res))
    if res.greedy:
        con.print(for_terminal(_greedy_line(res, ref_name)))
    if res.not_covered:
        cps = sorted({u["checkpoint"] for u in res.not_covered}, key=lambda c: (len(c), c))
        con.print(for_terminal(f"not covered: {len(res.not_covered)} comparisons in checkpoint(s) {', '.join(cps)} "
                               f"(e.g. {res.not_covered[0]['why']}); not covered is not passed"))
    for w in res.warnings:
        con.print(for_terminal(f"warning: {w}"))
    for line in _divergence_lines(res):
        con.print(for_terminal(line))
    v = res.verdict()
    con.print(for_terminal(v.coverage_line()))
    con.print(for_terminal(v.line()))


def console_for(file=None) -> Console:
    """A terminal gets its own width; a file or a pipe gets 100 columns (tables fold to fit). Text is printed as
    it is: no rich markup (`[/]` in an engine's name) and no emoji codes (`:warning:`) are interpreted; what
    comes from a file is escaped for the terminal by the caller (for_terminal)."""
    out = file or sys.stdout                                   # stdout at call time (tests capture it)
    return Console(file=out, width=None if out.isatty() else 100, markup=False, emoji=False)


def fmt_band(band: dict) -> str:
    """A band in a few characters: upper limits as <=, lower limits as >= (nmse<=0.029, prefix>=6)."""
    short = {"equal_prefix": "prefix", "agreement": "agree"}
    return ", ".join(f"{short.get(k, k)}{'>=' if k in ('cosine', 'agreement', 'equal_prefix') else '<='}{v:.3g}"
                     for k, v in band.items())


def _verdict(s, rows) -> str:
    if s["passed"] is None:
        return "NOT COVERED"
    v = "FAIL" if any(r.diverges for r in rows) else "pass"            # Row.diverges: the verdict's own rule
    return v + (f" ({s['not_covered']} n/c)" if s.get("not_covered") else "")


FOLDING = ("name", "worst at")      # the columns a narrow console may fold; figures, bands, verdicts stay whole


def _table(title, cols) -> Table:
    """Names and places fold to fit the console; figures, bands and verdicts stay whole on one line. A rule under
    the header and one space between columns (no cell borders or padding): a checkpoint row fits 100 columns, the
    width of a file or a CI log, mostly on one line."""
    t = Table(title=for_terminal(title), box=box.SIMPLE_HEAD, padding=(0, 0), show_edge=False)
    for col in cols:
        t.add_column(col, overflow="fold", no_wrap=col not in FOLDING)
    return t


def add_row(t: Table, *cells):
    """A row of text cells, each escaped for the terminal (tensor names and labels come from dumps)."""
    t.add_row(*(for_terminal(c) for c in cells))


def _summary_table(res, ref_name) -> Table:
    """One row per checkpoint, end to end: the worst figures over its tensors and layers beside the band."""
    t = _table(f"{res.subject_label} vs {ref_name}: {len(res.token_ids)} tokens, band class {res.band_class}",
               ["cp", "name", "n", "fail", "worst NMSE", "max abs", "cosine / tokens", "worst at", "band", "verdict"])
    for s in res.summary():
        at = s["worst_at"]
        rows = [r for r in res.rows if r.checkpoint == s["checkpoint"]]
        add_row(t, s["checkpoint"], s["name"], str(s["rows"]), str(s["failed"]), fmt(s["worst_nmse"]),
                fmt(s["worst_max_abs"]), fmt_match(s),
                f"L{at['layer']} {at['tensor']}" if at["layer"] is not None else at["tensor"], fmt_band(s["band"]),
                _verdict(s, rows))
    return t


def _local_table(res) -> Table:
    """One row per checkpoint, local (teacher-forced): the reference's operation on the subject's own inputs."""
    t = _table(f"local errors ({res.local_declaration} arithmetic): each operation on the subject's own inputs",
               ["cp", "name", "n", "worst local NMSE", "worst at", "local band", "local failed", "verdict"])
    for s in res.summary():
        rows = [r for r in res.rows if r.checkpoint == s["checkpoint"]]
        lrows = [r for r in rows if r.local is not None]
        if not lrows:
            add_row(t, s["checkpoint"], s["name"], "0", "-", "-", "-", "-", _verdict(s, rows))
            continue
        nm = [r for r in lrows if "nmse" in r.local]
        w = max(nm, key=lambda r: r.local["nmse"]) if nm else None
        worst = fmt(w.local["nmse"]) if w else f"agreement {min(r.local['agreement'] for r in lrows):.3f}"
        where = (f"L{w.layer} {w.tensor}" if w.layer is not None else w.tensor) if w else "-"
        add_row(t, s["checkpoint"], s["name"], str(len(lrows)), worst, where, fmt_band(lrows[0].local_band),
                str(sum(not r.local_passed for r in lrows)), _verdict(s, rows))
    return t


def _every_comparison(res) -> Table:
    d = _table("every comparison", ("cp", "layer", "tensor", "shape", "max abs", "max rel", "NMSE", "cosine / tokens",
                                     "band", "pass"))
    for r in res.rows:
        m = r.metrics
        add_row(d, r.checkpoint, "" if r.layer is None else str(r.layer), r.tensor, str(m.get("shape")),
                fmt(m.get("max_abs")), fmt(m.get("max_rel")), fmt(m.get("nmse")), fmt_row_match(m, r.band),
                fmt_band(r.band), "yes" if r.passed else "NO")
    return d


def _greedy_line(res, ref_name) -> str:
    g = res.greedy
    line = f"greedy: {g['equal_prefix']}/{g['n']} tokens equal to {ref_name} (EOS ignored)"
    band = next((r.band for r in res.rows if r.checkpoint == "12"), {})
    if g["equal_prefix"] < g["n"] and "equal_prefix" in band:
        # quantized weights: the exact reference and llama.cpp's quantized products part at a near-tie
        line += (f"; the {res.band_class} band asks for the first {band['equal_prefix']} (the exact reference and "
                 f"quantized arithmetic part at near-ties: docs/validation.md)")
    return line


def _divergence_lines(res) -> list[str]:
    fd = res.first_divergence
    if fd is None:
        return ["first divergence: none (every comparison inside its band)"]
    out = [f"first divergence: checkpoint {fd['checkpoint']}, layer {fd['layer']}, tensor {fd['tensor']} "
           f"(by {fd['by']})"]
    row = min((r for r in res.rows if r.diverges), key=lambda r: r.order)
    if row.local is not None and "nmse" not in row.local:
        out.append(f"  local check: the subject's tokens against the argmax of its own logits: {row.local}")
    elif row.local is not None:
        out.append(f"  local error (the reference's operation on the subject's own inputs): NMSE "
                   f"{fmt(row.local['nmse'])}, max abs {fmt(row.local['max_abs'])}, cosine "
                   f"{fmt_cos(row.local['cosine'])} (band {json.dumps(row.local_band)}); end to end: NMSE "
                   f"{fmt(row.metrics.get('nmse'))}")
    if (row.local or {}).get("error"):
        out.append(f"  {row.local['error']}")
    if row.metrics.get("error"):
        out.append(f"  {row.metrics['error']}")
    return out


def print_by_position(res, buckets: int = 16, file=None):
    """Error by position: the rows held in at most `buckets` consecutive groups, each with its worst NMSE over
    every tensor and layer (end to end, and local where measured) and where that worst is."""
    bp = res.by_position()
    pos = bp["positions"]
    if not pos or not bp["worst_nmse"]:
        return
    con = console_for(file)
    t = Table(title=f"error by position: {len(pos)} rows held of positions {pos[0]}..{pos[-1]}")
    local = bool(bp["worst_local_nmse"])
    for col in ["positions", "rows", "worst NMSE", "at"] + (["worst local NMSE", "at (local)"] if local else []):
        t.add_column(col)
    size = -(-len(pos) // buckets)
    for i in range(0, len(pos), size):
        j = range(i, min(i + size, len(pos)))
        w = max(j, key=lambda k: bp["worst_nmse"][k])
        cells = [f"{pos[j[0]]}..{pos[j[-1]]}", str(len(j)), fmt(bp["worst_nmse"][w]), bp["worst_at"][w]]
        if local:
            wl = max(j, key=lambda k: bp["worst_local_nmse"][k])
            cells += [fmt(bp["worst_local_nmse"][wl]), bp["local_worst_at"][wl]]
        add_row(t, *cells)
    con.print(t)
