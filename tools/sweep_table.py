"""A sweep's --json as committed evidence: RESULTS.json (made_by first: commit and command) and RESULTS.md (the
command and commit in its first lines, the counts, the cells' table, the smallest failing case).

    python tools/sweep_table.py SWEEP.json results/sweep/NAME "COMMAND" [CPU]
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import made_at


def main(raw, out, command, cpu=""):
    data = json.loads(Path(raw).read_text())
    commit = made_at.commit()
    Path(out + ".json").write_text(json.dumps({"made_by": {"commit": commit, "command": command, "cpu": cpu},
                                               **data}, indent=1) + "\n")
    c = data["counts"]
    lines = [f"# sweep: {data['spec']['subject']}", "", f"Made by `{command}` at commit {commit}"
             + (f" on {cpu}" if cpu else "") + ".", "",
             f"{len(data['cells'])} cells: {c['PASS']} PASS, {c['FAIL']} FAIL, {c['INCOMPLETE']} INCOMPLETE; "
             f"{data['where']}, wall {data['wall_s']:.0f} s.", "",
             "| length | steps | settings | verdict | first divergence / reason | s |", "|---|---|---|---|---|---|"]
    for r in data["cells"]:
        fd = r.get("first_divergence")
        why = (f"cp{fd['checkpoint']} {fd['tensor']} (by {fd['by']})" if fd else
               "; ".join(r.get("reasons", []))[:160] or "-")
        if r.get("sequence") is not None and fd:
            why = f"sequence {r['sequence']}: {why}"
        sets = " ".join(f"{k}={v}" for k, v in r["settings"].items())
        lines.append(f"| {r['length']} | {r['steps']} | {sets} | {r['status']} | {why} | {r['seconds']:.1f} |")
    s = data.get("smallest_failing")
    if s:
        lines += ["", f"Smallest failing case: {s['label']}: `{s['command']}`"]
    Path(out + ".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main(*sys.argv[1:])
