"""The Markdown of a proof bundle: each checkpoint's report.md, and summary.md (the run's verdict and one row
per checkpoint; also what CI shows as the step summary). Every figure beside its band; each report names the
files beside it."""
from __future__ import annotations

import json

from .blackbox import divergence_lines
from .metrics import fmt, fmt_match, fmt_row_match
from .text_safety import for_markdown as md
from .text_safety import for_markdown_block
from .text_safety import for_markdown_code as code


def row_json(r) -> dict:
    m = {k: v for k, v in r.metrics.items() if k not in ("ours", "reference")}
    return {"layer": r.layer, "tensor": r.tensor, "step": r.step, **m, "band": r.band, "passed": r.passed,
            **({"local": r.local, "local_band": r.local_band, "local_passed": r.local_passed}
               if r.local is not None else {})}


def simd_phrase(d):
    """' (avx512 build)' where a manifest or a dump's arithmetic names the llama.cpp build numerics ggml
    reproduces (key ggml_simd), else ''."""
    return f" ({md(d['ggml_simd'])} build)" if d.get("ggml_simd") else ""


def _settings_of(side) -> str:
    """'; settings `{...}`' of one side's manifest (numerics, K/V type, engine settings), or ''."""
    ar = (side or {}).get("arithmetic")
    return f"; arithmetic {code(json.dumps(ar))}" if ar else ""


def _local_cells(r) -> list[str]:
    if r.local is None:
        return ["-", "-", "-"]
    fig = fmt(r.local["nmse"]) if "nmse" in r.local else fmt_row_match(r.local, r.local_band)
    return [fig, f"`{json.dumps(r.local_band)}`", "yes" if r.local_passed else "**NO**"]


def checkpoint(spec, rows, man, passed, missing=(), plot=None, tensors=True) -> str:
    """report.md of one checkpoint: verdict, what is compared, the sides, every comparison with its band. What
    a dump, a model file or a command line gave (names, paths, the prompt, tensors) is escaped (for_markdown)."""
    n_local = sum(r.local is not None for r in rows)
    verdict = ("PASS" if passed else "FAIL") if rows else "NOT COVERED"
    lines = [f"# Checkpoint {spec.id}: {spec.title}", "",
             f"**Verdict: {verdict}** ({sum(r.passed for r in rows)}/{len(rows)} comparisons inside the band for "
             f"weight class {code(man['band_class'])}"
             + (f"; {sum(bool(r.local_passed) for r in rows if r.local)}/{n_local} local errors inside their bands: "
                f"the local error decides" if n_local else "") + ")", "",
             f"What is compared: {spec.checks}", "",
             f"- subject: {md(man['subject'])}, from {code(man['model'])} (sha256 {code(man['model_sha256'])})",
             f"- reference: {md(man['reference'])} on {code(man['reference_model'])} "
             f"(sha256 {code(man['reference_model_sha256'])})",
             f"- prompt: {md(json.dumps(man['prompt'])) if man['prompt'] else '(none: token ids given)'} -> "
             f"{len(man['token_ids'])} tokens",
             f"- llorch-ref: numerics {md(man['numerics'])}{simd_phrase(man)}, K/V cache {md(man['kv_dtype'])}, "
             f"backend {md(man['backend'])} ({md(man['device'])}); version {md(man['llorch_ref_version'])} at "
             f"{md(man['git_commit'])}", "",
             "Raw figures beside each band; inside the band is not 'identical'. The similarity column holds a cosine "
             "for tensors, the agreement fraction for token ids and argmax, the equal prefix for the greedy text.", "",
             "| step | layer | tensor | shape | max abs | max rel | NMSE | cosine / tokens | band | pass "
             "| local NMSE | local band | local pass |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        m = r.metrics
        lines.append(f"| {r.step} | {'' if r.layer is None else r.layer} | {md(r.tensor)} | {md(m.get('shape'))} | "
                     f"{fmt(m.get('max_abs'))} | {fmt(m.get('max_rel'))} | {fmt(m.get('nmse'))} | "
                     f"{fmt_row_match(m, r.band)} | `{json.dumps(r.band)}` | {'yes' if r.passed else '**NO**'} | "
                     + " | ".join(_local_cells(r)) + " |")
    if missing:
        lines += ["", f"**Not covered: {len(missing)} comparisons** (not covered is not passed): "
                      f"{md(missing[0]['why'])}."]
    kept = ("`subject.npz` and `reference.npz` (the tensors both sides produced, dump names "
            "`cp<id>.<tensor>.layer<L>[.step<K>]`, canonical layout)" if tensors else
            "no tensors (the run was written with --no-tensors)")
    lines += ["", "Files beside this report: `report.json` (these rows), " + kept
              + (f", `{plot}` (NMSE by layer, end to end and local, with the band)" if plot else "") + ".",
              "", "Re-run:", "", *for_markdown_block(man["command"]), ""]
    return "\n".join(lines)


def _verdict(result) -> str:
    fd = result.first_divergence
    n_nc = len({u["checkpoint"] for u in result.not_covered})
    if fd is not None:
        return (f"DIVERGED at checkpoint {fd['checkpoint']}, layer {fd['layer']}, {md(fd['tensor'])}"
                + (f" (decode step {fd['step']})" if fd.get("step") else "") + f", by {md(fd['by'])}")
    v = result.verdict()
    if not v.passed:            # INCOMPLETE: nothing outside a band, less compared than the verdict requires
        return (f"INCOMPLETE: {len(v.missing)} of {len(v.required)} required tensors not compared"
                if v.missing else "INCOMPLETE: " + md("; ".join(v.reasons)))
    return ("every checkpoint inside its band" if not n_nc else
            f"every covered checkpoint inside its band; {n_nc} checkpoint(s) not (fully) covered")


def summary(result, man, run_id, specs, links=True) -> str:
    """summary.md: verdict, the sides, one row per checkpoint (worst figures, band, verdict), the greedy text,
    warnings, how to re-run. links: link each checkpoint's report (off for a CI step summary). What a dump, a
    model file or a command line gave is escaped (for_markdown): no heading, HTML or table cell of its own."""
    by_id = {s.id: s for s in specs}
    verdict = result.verdict()
    lines = [f"# Proof run {md(run_id)}: {_verdict(result)}", "",
             f"**Verdict: {verdict.status}** ({md(verdict.coverage_line())})", "",
             f"- subject: {md(man['subject'])}, from {code(man['model'])} (sha256 "
             f"{code(man['model_sha256'][:16] + '…')})"
             + _settings_of(man["sides"].get("subject")),
             f"- reference: {md(man['reference'])} on {code(man['reference_model'])} (sha256 "
             f"{code(man['reference_model_sha256'][:16] + '…')})" + _settings_of(man["sides"].get("reference")),
             f"- band class {code(result.band_class)}",
             f"- prompt {md(json.dumps(result.prompt)) if result.prompt else '(none: token ids given)'}: "
             f"{len(result.token_ids)} tokens; llorch-ref {md(man['llorch_ref_version'])} at {md(man['git_commit'])}, "
             f"backend {md(man['backend'])}, numerics {md(man['numerics'])}{simd_phrase(man)}, K/V "
             f"{md(man['kv_dtype'])}; CPU {md(man['cpu_model'])}", "",
             "| checkpoint | name | comparisons | failed | worst NMSE | worst max abs | min cosine / tokens | worst at | "
             "band | local failed | verdict |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in result.summary():
        at = s["worst_at"]
        local = [r for r in result.rows if r.checkpoint == s["checkpoint"] and r.local_passed is not None]
        verdict = "NOT COVERED" if s["passed"] is None else (
            "pass" if not any(r.diverges for r in result.rows if r.checkpoint == s["checkpoint"]) else "**FAIL**")
        if s.get("not_covered") and s["passed"] is not None:
            verdict += f" ({s['not_covered']} not covered)"
        name = s["name"]
        if links and s["checkpoint"] in by_id:
            name = f"[{name}]({checkpoint_folder(by_id[s['checkpoint']])}/report.md)"
        lines.append(f"| {s['checkpoint']} | {name} | {s['rows']} | {s['failed']} | {fmt(s['worst_nmse'])} | "
                     f"{fmt(s['worst_max_abs'])} | {fmt_match(s) if s['passed'] is not None else '-'} | "
                     f"{'' if at['layer'] is None else 'L' + str(at['layer']) + ' '}{md(at['tensor'])} | "
                     f"`{json.dumps(s['band'])}` | "
                     f"{sum(not r.local_passed for r in local) if local else '-'} | {verdict} |")
    if result.greedy:
        g = result.greedy
        band = next((r.band for r in result.rows if r.checkpoint == "12"), {})
        lines += ["", f"Greedy text: {g['equal_prefix']}/{g['n']} tokens equal to {md(result.reference_label)} (EOS "
                  f"ignored)" + (f"; the band asks for the first {band['equal_prefix']}" if "equal_prefix" in band
                                 else "") + "."]
    if str(result.band_class or "").startswith("blackbox:"):
        lines += ["", "Step by step: `steps.md` (KLD, rank and log-probabilities of the engine's token each step); "
                  "the engine's run as it answered: `trace.json`, `trace.npz`."]
        lines += [f"- {md(d.strip())}" for d in divergence_lines(result)]
    for w in result.warnings:
        lines += ["", f"Warning: {md(w)}"]
    if result.not_covered:
        lines += ["", f"Not covered: {len(result.not_covered)} comparisons (not covered is not passed); e.g. "
                  f"{md(result.not_covered[0]['why'])}."]
    if links:
        lines += ["", "Open `report.html` for the figures; `junit.xml` for CI; `manifest.json` holds the sha256 of "
                  "every file (`llorch-ref verify` checks them and re-runs the reference)"
                  + ("; `repro/` holds the first divergence as a standalone test (`pytest repro/`)"
                     if result.first_divergence else "") + "."]
    lines += ["", "Re-run: " + code(man["command"]), ""]
    return "\n".join(lines)


def checkpoint_folder(spec) -> str:
    return f"cp{spec.id}_{spec.name}"
