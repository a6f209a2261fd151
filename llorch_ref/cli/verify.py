"""llorch-ref verify BUNDLE: the bundle walked without following a link, its files against their sha256, its code
against what llorch-ref writes, every page against the verdict of its rows, then (unless --no-rerun) the
reference side run again from the manifest and the figures and verdict redone; with --key, manifest.json.sig
checked against that public key. Exit 0: every file as written, no code but llorch-ref's, every page states
the rows' verdict, the figures hold (and the signature, when checked); 1: a file edited, missing or added, a
code file refused, a page or the manifest contradicts the rows, a verdict changed or the signature fails;
2: bad input (not a bundle, a symbolic link or special file in it, the model file missing)."""
from __future__ import annotations

import json

from ..harness.metrics import fmt
from ..harness.text_safety import for_terminal
from ..harness.verify import HASH_CAVEAT, verify_bundle
from .common import log


def say(line: str):
    """One line on stdout, every character a terminal would act on escaped (file names come from the bundle)."""
    print(for_terminal(line))


def _say_rerun(r: dict):
    """The re-run's lines: the reference's tensors, the figures, what changed."""
    lc = r["largest_change"]
    say(f"reference run again: {r['reference_bit_equal']} of {r['reference_tensors']} tensors bit-equal to the "
        f"bundle's" + (f" (worst NMSE {fmt(r['reference_worst']['nmse'])} at {r['reference_worst']['tensor']})"
                       if r["reference_worst"]["tensor"] else ""))
    say(f"figures: {r['comparisons']} comparisons redone, {len(r['verdicts_changed'])} verdicts changed; "
        f"largest relative change {fmt(lc['relative_change'])}"
        + (f" ({lc['figure']}: {fmt(lc['bundle'])} -> {fmt(lc['now'])})" if lc["figure"] else ""))
    for c in r["verdicts_changed"][:10]:
        say(f"  changed: {c}")
    for c in r.get("reference_faults", [])[:10]:
        say(f"  reference: {c}")
    fd = r["first_divergence"]
    if fd["bundle"] != fd["now"]:
        say(f"  first divergence: {fd['bundle']} in the bundle's rows, {fd['now']} now")
    if not r["verdict_holds"]:
        say(f"  verdict: the bundle's rows give {r['rows_status']}, the re-run {r['verdict']['status']}")


def _say_verdict(v):
    """The verdict (the re-run's where it ran, else the rows'), its coverage, the band class, the model files."""
    verdict = v.rerun["verdict"] if v.rerun and v.rerun.get("verdict") else v.verdict
    if verdict:
        say(verdict["line"] + ("" if v.rerun and v.rerun.get("verdict") else " (from the bundle's rows)"))
        say(verdict["coverage"])
    say(f"band class {v.band_class}")
    m = v.model
    say(f"reference model: {m['path']} (sha256 {m['sha256']}; "
        + (f"read from {m['read']} and re-run" if m.get("checked") else "not re-run") + ")")
    s = v.subject_model
    if s.get("path") != m["path"] or s.get("sha256") != m["sha256"]:
        say(f"subject model: {s.get('path')} (sha256 {s.get('sha256')})")


def _say_signature(s: dict):
    """The signature's line: good or BAD under the key given; else signed by which key, or unsigned."""
    if s.get("checked"):
        say(f"signature: good: {s['why']}" if s["good"] else f"SIGNATURE BAD: {s['why']}")
    elif s.get("signed"):
        say(f"signature: present (key {str(s['signer'])[:16]}…), not checked: pass --key PUBKEY (the key the bundle "
            f"names proves nothing by itself)")
    else:
        say("signature: none (prove --sign KEYFILE signs a bundle)")


def _failures(v) -> str:
    r = v.rerun
    return "; ".join(x for x in (
        f"{', '.join(v.edited)} edited" if v.edited else "",
        f"{len(v.missing)} file(s) missing" if v.missing else "",
        f"{len(v.added)} file(s) added" if v.added else "",
        f"{len(v.refused)} code file(s) refused" if v.refused else "",
        "the signature does not hold" if v.signature.get("good") is False else "",
        f"{len(v.contradictions)} contradiction(s) of the rows' verdict" if v.contradictions else "",
        "the manifest contradicts the files" if v.manifest_faults else "",
        f"the re-run gives {r['verdict']['status']}, the bundle's rows {r['rows_status']}"
        if r is not None and r.get("verdict_holds") is False else "",
        "the figures do not hold" if r is not None and r["figures_hold"] is False and r.get("verdict_holds") is not False
        else "") if x)


def cmd_verify(args):
    v = verify_bundle(args.bundle, rerun=not args.no_rerun, model=args.model, log=log, key=args.key)
    if args.json:
        print(json.dumps(v.to_json(), indent=2, default=str))
        return 0 if v.ok else 1
    for what, names in (("EDITED after the run", v.edited), ("MISSING", v.missing), ("ADDED after the run", v.added),
                        ("REFUSED code file", v.refused), ("CONTRADICTS the rows' verdict", v.contradictions),
                        ("CONTRADICTS the files present", v.manifest_faults)):
        for n in names:
            say(f"{what}: {n}")
    n_files = v.n_files
    say(f"files: {n_files - len(v.edited) - len(v.missing)} of {n_files} as written (sha256)"
        + ("" if v.files_ok else f"; {len(v.edited)} edited, {len(v.missing)} missing, {len(v.added)} added"))
    r = v.rerun
    if r is not None and r["figures_hold"] is None:
        say(f"figures: not redone: {r['why']}")
        r = None
    if r is not None:
        _say_rerun(r)
    _say_verdict(v)
    _say_signature(v.signature)
    for n in v.notes:
        say(f"note: {n}")
    say(f"note: {HASH_CAVEAT}")
    say(f"verify: {'OK' if v.ok else 'FAILED'}: " + (
        "every file as written, no code but llorch-ref's, every page states the rows' verdict"
        + ("" if r is None else " and the figures hold")
        + (", signed by the key given" if v.signature.get("good") else "") if v.ok else _failures(v)))
    return 0 if v.ok else 1
