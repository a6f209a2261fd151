"""llorch-ref verify BUNDLE: the bundle's files against their sha256, then (unless --no-rerun) the reference
side run again from the manifest and the figures redone. Exit 0: every file as written and the figures hold;
1: a file was edited, is missing or was added, or a verdict changed; 2: bad input."""
from __future__ import annotations

import json

from ..harness.metrics import fmt
from ..harness.text_safety import for_terminal
from ..harness.verify import verify_bundle
from .common import log


def say(line: str):
    """One line on stdout, every character a terminal would act on escaped (file names come from the bundle)."""
    print(for_terminal(line))


def cmd_verify(args):
    v = verify_bundle(args.bundle, rerun=not args.no_rerun, model=args.model, log=log)
    if args.json:
        print(json.dumps(v.to_json(), indent=2, default=str))
        return 0 if v.ok else 1
    for what, names in (("EDITED after the run", v.edited), ("MISSING", v.missing), ("ADDED after the run", v.added)):
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
        lc = r["largest_change"]
        say(f"reference run again: {r['reference_bit_equal']} of {r['reference_tensors']} tensors bit-equal to the "
            f"bundle's" + (f" (worst NMSE {fmt(r['reference_worst']['nmse'])} at {r['reference_worst']['tensor']})"
                           if r["reference_worst"]["tensor"] else ""))
        say(f"figures: {r['comparisons']} comparisons redone, {len(r['verdicts_changed'])} verdicts changed; "
            f"largest relative change {fmt(lc['relative_change'])}"
            + (f" ({lc['figure']}: {fmt(lc['bundle'])} -> {fmt(lc['now'])})" if lc["figure"] else ""))
        for c in r["verdicts_changed"][:10]:
            say(f"  changed: {c}")
        fd = r["first_divergence"]
        if fd["bundle"] != fd["now"]:
            say(f"  first divergence: {fd['bundle']} in the bundle, {fd['now']} now")
    say(f"verify: {'OK' if v.ok else 'FAILED'}: " + (
        "every file as written" + ("" if r is None else " and the figures hold") if v.ok else
        "; ".join(x for x in ((f"{', '.join(v.edited)} edited" if v.edited else ""),
                              (f"{len(v.missing)} file(s) missing" if v.missing else ""),
                              (f"{len(v.added)} file(s) added" if v.added else ""),
                              ("the figures do not hold" if r is not None and not r["figures_hold"] else "")) if x)))
    return 0 if v.ok else 1
