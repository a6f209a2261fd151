"""JUnit XML of a comparison, for CI systems: a test suite per checkpoint, a test case per compared tensor,
layer and decode step (`cp5.attn_out L3 @step2`); a case fails where it diverges (by its local error where
measured, else end to end), its message the figures beside the band; what was not covered is a skipped case;
the run's verdict is one more case (llorch_verdict), failing on FAIL and INCOMPLETE.
"""
from __future__ import annotations

import json
import xml.etree.ElementTree as ET

from .metrics import fmt, fmt_row_match
from .text_safety import for_xml


def _figures(r) -> str:
    m = r.metrics
    end = (f"end to end: max abs {fmt(m.get('max_abs'))}, max rel {fmt(m.get('max_rel'))}, NMSE {fmt(m.get('nmse'))}, "
           f"{fmt_row_match(m, r.band)}; band {json.dumps(r.band)}: {'inside' if r.passed else 'OUTSIDE'}")
    if r.local is None:
        return end
    lo = fmt(r.local["nmse"]) if "nmse" in r.local else fmt_row_match(r.local, r.local_band)
    return (f"local (the reference's operation on the subject's inputs): NMSE {lo}; band "
            f"{json.dumps(r.local_band)}: {'inside' if r.local_passed else 'OUTSIDE'}. {end}")


def _case_name(cp, layer, tensor) -> str:
    base, _, step = tensor.partition("@")
    return f"cp{cp}.{base}" + ("" if layer is None else f" L{layer}") + (f" @{step}" if step else "")


def _only_xml_characters(root: ET.Element):
    """Every attribute value and text under root through for_xml: labels, tensor names and reasons come from
    dumps and manifests, and a character XML 1.0 forbids (NUL, ESC, ...) would make the whole file unreadable."""
    for el in root.iter():
        el.attrib = {k: for_xml(v) for k, v in el.attrib.items()}
        if el.text is not None:
            el.text = for_xml(el.text)


def _verdict_suite(root, v) -> int:
    """The run's verdict as a test case of its own (suite llorch_verdict, case verdict): it fails on FAIL and on
    INCOMPLETE, so a CI that counts failures never reads a run that covered too little as green. -> failures."""
    suite = ET.SubElement(root, "testsuite", name="llorch_verdict", tests="1", failures="0" if v.passed else "1",
                          skipped="0", errors="0")
    ET.SubElement(ET.SubElement(suite, "properties"), "property", name="llorch.verdict", value=v.status)
    case = ET.SubElement(suite, "testcase", classname="llorch.verdict", name="verdict")
    text = f"{v.line()}; {v.coverage_line()}"
    if v.passed:
        ET.SubElement(case, "system-out").text = text
        return 0
    ET.SubElement(case, "failure", message=text, type=v.status.lower()).text = text
    return 1


def xml(result, run_id: str) -> str:
    root = ET.Element("testsuites", name=f"llorch-ref {run_id}: {result.subject_label} vs {result.reference_label}")
    total = failures = skipped = 0
    status = result.verdict().status            # every suite carries the run's verdict (`verify` reads it)
    for spec in result.specs:
        rows = [r for r in result.rows if r.checkpoint == spec.id]
        missing = [u for u in result.not_covered if u["checkpoint"] == spec.id]
        if not rows and not missing:
            continue
        suite = ET.SubElement(root, "testsuite", name=f"cp{spec.id}_{spec.name}")
        ET.SubElement(ET.SubElement(suite, "properties"), "property", name="llorch.verdict", value=status)
        bad = 0
        for r in rows:
            case = ET.SubElement(suite, "testcase", classname=f"llorch.cp{spec.id}_{spec.name}",
                                 name=_case_name(spec.id, r.layer, r.tensor))
            text = _figures(r)
            if r.diverges:
                bad += 1
                ET.SubElement(case, "failure", message=text, type="outside band").text = text
            else:
                ET.SubElement(case, "system-out").text = text
        for u in missing:
            case = ET.SubElement(suite, "testcase", classname=f"llorch.cp{spec.id}_{spec.name}",
                                 name=_case_name(spec.id, u["layer"], u["tensor"]))
            ET.SubElement(case, "skipped", message=f"not covered: {u['why']}")
        suite.set("tests", str(len(rows) + len(missing)))
        suite.set("failures", str(bad))
        suite.set("skipped", str(len(missing)))
        suite.set("errors", "0")
        total, failures, skipped = total + len(rows) + len(missing), failures + bad, skipped + len(missing)
    bad = _verdict_suite(root, result.verdict())
    total, failures = total + 1, failures + bad
    root.set("tests", str(total))
    root.set("failures", str(failures))
    root.set("skipped", str(skipped))
    root.set("errors", "0")
    _only_xml_characters(root)
    ET.indent(root)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"
