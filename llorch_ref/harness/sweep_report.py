"""A sweep's outputs: the terminal table's rows, JUnit XML (one case per cell, failing on FAIL and INCOMPLETE as a
bundle's verdict case does), and report.html: a heat map of lengths x (settings, steps), each cell coloured by its
verdict and linked to its bundle where it failed, in the bundle page's style (its template's stylesheet)."""
from __future__ import annotations

import html
import json
import xml.etree.ElementTree as ET
from importlib import resources

from .sweep import Cell, fmt_value
from .text_safety import for_xml
from .verdict import FAIL, INCOMPLETE, PASS

COLOURS = {PASS: "#2e8b57", FAIL: "#c0392b", INCOMPLETE: "#d39e00"}


def divergence_text(rec: dict) -> str:
    """A cell's first divergence (or what it raised) in a few words; '-' where it has none."""
    fd = rec.get("first_divergence")
    if fd:
        return (f"cp{fd['checkpoint']} {fd['tensor']}" + ("" if fd.get("layer") is None else f" L{fd['layer']}")
                + (f" step {fd['step']}" if fd.get("step") else "") + f" ({fd['by']})")
    if rec.get("raised"):
        return f"raised {rec['raised']}"
    return "-" if rec["status"] == PASS else "; ".join(rec.get("reasons", []))[:120]


def cell_of(rec: dict) -> Cell:
    return Cell(rec["length"], rec["steps"], tuple(rec["settings"].items()))


def table_rows(records) -> list[list[str]]:
    """[length, steps, settings, status, first divergence, seconds] per cell, as the terminal prints them."""
    return [[str(r["length"]), str(r["steps"]),
             " ".join(f"{k}={fmt_value(v)}" for k, v in r["settings"].items()) or "-", r["status"],
             divergence_text(r), f"{r['seconds']:.2f}"] for r in records]


def junit_xml(result) -> str:
    """One test suite, one case per cell (named by its label), with the cell's verdict as a property; a FAIL or
    INCOMPLETE cell has a <failure> of that type, its reasons the message."""
    root = ET.Element("testsuites", name=f"llorch-ref sweep: {result.spec.subject}")
    bad = sum(r["status"] != PASS for r in result.cells)
    suite = ET.SubElement(root, "testsuite", name="llorch_sweep", tests=str(len(result.cells)), failures=str(bad),
                          errors="0", skipped="0", time=f"{result.wall_s:.3f}")
    ET.SubElement(ET.SubElement(suite, "properties"), "property", name="llorch.verdict", value=result.status)
    for r in result.cells:
        case = ET.SubElement(suite, "testcase", classname="llorch.sweep", name=cell_of(r).label(),
                             time=f"{r['seconds']:.3f}")
        ET.SubElement(ET.SubElement(case, "properties"), "property", name="llorch.verdict", value=r["status"])
        text = f"verdict: {r['status']}; first divergence: {divergence_text(r)}; " + "; ".join(r.get("reasons", []))
        if r["status"] == PASS:
            ET.SubElement(case, "system-out").text = text
        else:
            ET.SubElement(case, "failure", message=text, type=r["status"].lower()).text = text
    for el in root.iter():
        el.attrib = {k: for_xml(v) for k, v in el.attrib.items()}
        if el.text is not None:
            el.text = for_xml(el.text)
    return ET.tostring(root, encoding="unicode", xml_declaration=True)


def page_style() -> str:
    """The bundle page's stylesheet, read from its template (report.html.j2), so both pages look alike."""
    t = resources.files("llorch_ref.harness").joinpath("templates/report.html.j2").read_text(encoding="utf-8")
    return t[t.index("<style>"):t.index("</style>") + len("</style>")]


def columns(result) -> list[tuple]:
    """The heat map's columns: (settings, steps) in the matrix's order."""
    seen = []
    for r in result.cells:
        k = (tuple(r["settings"].items()), r["steps"])
        if k not in seen:
            seen.append(k)
    return seen


def render_html(result) -> str:
    """report.html of a sweep: the verdict, the counts, the smallest failing case and its command, the heat map
    (lengths down, settings and steps across; a failing cell links to its bundle), and every cell's row."""
    e = html.escape
    cols, lengths = columns(result), sorted({r["length"] for r in result.cells})
    at = {(r["length"], tuple(r["settings"].items()), r["steps"]): r for r in result.cells}
    counts = result.to_json()["counts"]
    cls = {PASS: "pass", FAIL: "fail", INCOMPLETE: "partial"}[result.status]
    out = ["<!DOCTYPE html>", '<html lang="en">', '<head><meta charset="utf-8">',
           f"<title>llorch-ref sweep: {e(result.spec.subject)}</title>", page_style(),
           "<style>td.cell { width: 22px; height: 16px; padding: 0; } td.cell a { display: block; height: 100%; }"
           "</style></head>", "<body><main>", f"<h1>llorch-ref sweep: {e(result.spec.subject)} on "
           f"{e(str(result.spec.model or 'the default model'))}</h1>",
           f'<div id="verdict" data-verdict="{result.status}" class="verdict {cls}">{result.status}: '
           f"{counts[PASS]} pass, {counts[FAIL]} fail, {counts[INCOMPLETE]} incomplete of {len(result.cells)} cells"
           "</div>", f'<p class="meta">{e(result.where)}; wall {result.wall_s:.1f} s</p>']
    if result.smallest:
        s = result.smallest
        out += ['<div class="card bad"><b>smallest failing case</b>: ' + e(s["label"]) + " &mdash; "
                + e(divergence_text(s["cell"])) + f"<br><code>{e(s['command'])}</code></div>"]
    out += ["<h2>Heat map</h2>", '<table id="heatmap"><tr><th>length</th>']
    out += [f"<th>{e(' '.join(f'{k}={fmt_value(v)}' for k, v in st) or '-')}<br>steps {n}</th>" for st, n in cols]
    out.append("</tr>")
    for n in lengths:
        out.append(f"<tr><th>{n}</th>")
        for st, k in cols:
            r = at.get((n, st, k))
            if r is None:
                out.append("<td></td>")
                continue
            tip = e(f"{cell_of(r).label()}: {r['status']} {divergence_text(r)}")
            inner = f'<a href="bundles/{e(r["bundle"])}/report.html"></a>' if r.get("bundle") else ""
            out.append(f'<td class="cell" data-status="{r["status"]}" title="{tip}" '
                       f'style="background: {COLOURS[r["status"]]}">{inner}</td>')
        out.append("</tr>")
    out += ["</table>", "<h2>Cells</h2>",
            "<table><tr><th>length</th><th>steps</th><th>settings</th><th>verdict</th><th>first divergence</th>"
            "<th>s</th><th>bundle</th></tr>"]
    for r, row in zip(result.cells, table_rows(result.cells)):
        link = f'<a href="bundles/{e(r["bundle"])}/report.html">bundle</a>' if r.get("bundle") else ""
        out.append(f'<tr class="{"bad" if r["status"] != PASS else ""}">' + "".join(f"<td>{e(c)}</td>" for c in row)
                   + f"<td>{link}</td></tr>")
    out += ["</table>", "<h2>Sweep</h2>", f'<pre class="text">{e(json.dumps(result.to_json()["spec"], indent=1))}'
            "</pre>", "</main></body></html>"]
    return "\n".join(out)
