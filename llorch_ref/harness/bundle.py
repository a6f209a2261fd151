"""Proof bundles: proof_bundle/<checkpoint>/<run_id>/ {manifest.json, subject.npz, reference.npz, report.json,
report.md}, an index proof_bundle/<run_id>.md, and a PNG of error by layer.

Atomic: everything is written under proof_bundle/.incomplete-<run_id>-<pid>/; each bundle carries an
INCOMPLETE marker while it is moved into place; the index is moved in last, and only then are the markers
removed. A run is complete exactly when its index exists; a run killed at any point (kill -9 included)
leaves nothing without a marker and no index. A complete run id is never overwritten; the leftovers of a
killed run (marked, no index) are removed when the same run id is used again.
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from ..dump import model_sha256
from ..errors import HarnessError, OutputPathError
from ..output_paths import check_container, check_run_id
from .metrics import fmt, fmt_cos, fmt_match


def default_dir() -> Path:
    return Path(os.environ.get("LLORCH_PROOF_DIR") or "proof_bundle")


def default_run_id() -> str:
    return os.environ.get("LLORCH_RUN_ID") or _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")


def _git_commit() -> str | None:
    try:
        here = Path(__file__).resolve().parents[2]
        r = subprocess.run(["git", "-C", str(here), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
        if r.returncode == 0:
            dirty = subprocess.run(["git", "-C", str(here), "status", "--porcelain", "--untracked-files=no"],
                                   capture_output=True, text=True, timeout=5).stdout.strip()
            return r.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return None


def cpu_model() -> str:
    """The CPU's model name (named beside every speed figure)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                keep = ["sse3", "ssse3", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl",
                        "avx512_vnni", "avx_vnni", "amx_tile"]
                return " ".join(f for f in keep if f in flags)
    except OSError:
        pass
    return platform.processor()


def manifest(result, engine, argv, seed=0) -> dict:
    import gguf

    import llorch_ref

    try:
        import llama_cpp
        lcp = llama_cpp.__version__
        sysinfo = llama_cpp.llama_print_system_info().decode()
    except ImportError:
        lcp, sysinfo = None, None
    ref_sha = model_sha256(result.reference_model)
    model_sha = model_sha256(result.model) if result.model != result.reference_model else ref_sha
    return {
        "llorch_ref_version": llorch_ref.__version__,
        "git_commit": _git_commit(),
        "python": sys.version.split()[0],
        "numpy": np.__version__,
        "gguf": getattr(gguf, "__version__", None) or _dist_version("gguf"),
        "llama_cpp_python": lcp,
        "llama_cpp_system_info": sysinfo,
        "cpu_flags": _cpu_flags(),
        "machine": platform.machine(),
        "model": result.model,
        "model_sha256": model_sha,
        "reference_model": result.reference_model,
        "reference_model_sha256": ref_sha,
        "band_class": result.band_class,
        "subject": result.subject_label,
        "reference": result.reference_label,
        "not_covered": result.not_covered,
        "warnings": result.warnings,
        "backend": engine.backend.name,
        "numerics": engine.numerics,
        "kv_dtype": engine.kv_dtype,
        "device": engine.backend.device,
        "weights": engine.weights_info(),
        "peak_rss_mb": round(_peak_rss_mb(), 1),
        "prompt": result.prompt,
        "token_ids": result.token_ids,
        "sides": result.sides,
        "seed": seed,
        "command": " ".join(argv),
        "created_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(),
    }


def _peak_rss_mb() -> float:
    """Peak resident memory of this process so far (Linux ru_maxrss is in KiB); includes mapped file pages."""
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _dist_version(name):
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def _settings_of(side) -> str:
    """'; arithmetic `{...}`' of one side's manifest (numerics, K/V type, engine settings), or ''."""
    ar = (side or {}).get("arithmetic")
    return f"; arithmetic `{json.dumps(ar)}`" if ar else ""


def _spec_captures(result, spec):
    """The tensors of both sides that this checkpoint compared: dump names (cp<id>.<tensor>[.layer<L>]), both
    in the canonical layout."""
    pre = f"cp{spec.id}."
    return ({k: v for k, v in result.captures_ours.items() if k.startswith(pre)},
            {k: v for k, v in result.captures_ref.items() if k.startswith(pre)})


def _row_json(r):
    m = {k: v for k, v in r.metrics.items() if k not in ("ours", "reference")}
    return {"layer": r.layer, "tensor": r.tensor, **m, "band": r.band, "passed": r.passed,
            **({"local": r.local, "local_band": r.local_band, "local_passed": r.local_passed}
               if r.local is not None else {})}


def _report_md(spec, rows, man, run_id, passed, rerun):
    lines = [f"# Checkpoint {spec.id}: {spec.title}", "",
             f"**Verdict: {('PASS' if passed else 'FAIL') if rows else 'NOT COVERED'}** "
             f"({sum(r.passed for r in rows)}/{len(rows)} comparisons "
             f"inside the band for weight class `{man['band_class']}`"
             + (f"; {sum(bool(r.local_passed) for r in rows if r.local)}/{sum(r.local is not None for r in rows)} "
                f"local errors inside their bands: the local error decides" if any(r.local for r in rows) else "")
             + ")", "",
             f"What is compared: {spec.checks}", "",
             f"- model: `{man['model']}` (sha256 `{man['model_sha256']}`)",
             f"- subject: {man['subject']}",
             f"- reference: {man['reference']} on `{man['reference_model']}`",
             f"- prompt: {json.dumps(man['prompt']) if man['prompt'] else '(none: token ids given)'} -> "
             f"{len(man['token_ids'])} tokens",
             f"- numerics: {man['numerics']}, K/V cache {man['kv_dtype']}; "
             f"backend: {man['backend']} ({man['device']}); llorch-ref {man['llorch_ref_version']} "
             f"at {man['git_commit']}",
             f"- band: `{json.dumps(rows[0].band) if rows else '-'}` (raw figures below; inside the band is not "
             f"'identical')", "",
             "| layer | tensor | shape | max abs | max rel | NMSE | cosine | pass | local NMSE | local band | local pass |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        m = r.metrics
        lo = ([fmt(r.local["nmse"]) if "nmse" in r.local else f"agreement {r.local.get('agreement')}",
               f"`{json.dumps(r.local_band)}`", "yes" if r.local_passed else "**NO**"]
              if r.local is not None else ["-", "-", "-"])
        lines.append(f"| {'' if r.layer is None else r.layer} | {r.tensor} | {m.get('shape')} | "
                     f"{fmt(m.get('max_abs', ''))} | {fmt(m.get('max_rel', ''))} | {fmt(m.get('nmse', ''))} | "
                     f"{fmt_cos(m.get('cosine', m.get('agreement', m.get('equal_prefix', ''))))} | {'yes' if r.passed else '**NO**'} | "
                     + " | ".join(lo) + " |")
    missing = [u for u in man["not_covered"] if u["checkpoint"] == spec.id]
    if missing:
        lines += ["", f"**Not covered: {len(missing)} comparisons** (not covered is not passed): {missing[0]['why']}."]
    for w in man["warnings"]:
        lines += ["", f"Warning: {w}"]
    lines += ["", "Captured tensors: `subject.npz` and `reference.npz`, dump names (`cp<id>.<tensor>.layer<L>`),",
              "both in the canonical layout (each side's declared layouts undone)."]
    lines += ["",
              "Re-run:", "", "```", rerun, "```", ""]
    return "\n".join(lines)


def check_bundle_target(out_dir=None, run_id=None) -> tuple[Path, str]:
    """-> (out_dir, run_id), checked before any work: the folder is one (or can be made), the run id is a
    safe file name, and no completed run of that id is there (bundles are never overwritten)."""
    out_dir = check_container(out_dir or default_dir(), what="--out")
    run_id = check_run_id(run_id or default_run_id())
    index = out_dir / f"{run_id}.md"
    if os.path.lexists(index):
        raise HarnessError(f"run id {run_id!r} already exists ({index}); bundles are never overwritten: "
                           f"pick another --run-id or LLORCH_RUN_ID")
    return out_dir, run_id


def write_bundles(result, engine, out_dir=None, run_id=None, argv=None, seed=0, plot=True) -> dict:
    """-> {"index": path, "bundles": {checkpoint_id: path}}."""
    out_dir, run_id = check_bundle_target(out_dir, run_id)
    argv = argv or sys.argv
    specs = [s for s in result.specs if any(r.checkpoint == s.id for r in result.rows)
             or any(u["checkpoint"] == s.id for u in result.not_covered)]
    finals = {s.id: out_dir / f"cp{s.id}_{s.name}" / run_id for s in specs}
    index = out_dir / f"{run_id}.md"
    for p in finals.values():
        if p.exists():
            if (p / "INCOMPLETE").exists():
                shutil.rmtree(p)                  # left by a killed run of this id: never complete
            else:
                raise HarnessError(f"run id {run_id!r} already exists ({p}); bundles are never overwritten: "
                                   f"pick another --run-id or LLORCH_RUN_ID")
    out_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".incomplete-{run_id}-", dir=out_dir))   # unique: never a user's folder
    man = manifest(result, engine, argv, seed)
    rerun = " ".join(argv) if argv else "llorch-ref prove"
    written = {}
    try:
        for s in specs:
            rows = [r for r in result.rows if r.checkpoint == s.id]
            d = staging / f"cp{s.id}_{s.name}"
            d.mkdir()
            (d / "INCOMPLETE").write_text(f"run {run_id} has not finished; its index {index.name} does not exist yet\n")
            ours, ref = _spec_captures(result, s)
            np.savez_compressed(d / "subject.npz", **ours)
            np.savez_compressed(d / "reference.npz", **ref)
            passed = bool(rows) and not any(r.diverges for r in rows)   # local error decides where measured
            (d / "manifest.json").write_text(json.dumps({**man, "checkpoint": s.id, "spec": s.path.name},
                                                        indent=2) + "\n")
            (d / "report.json").write_text(json.dumps(
                {"checkpoint": s.id, "name": s.name, "title": s.title, "passed": passed,
                 "band_class": result.band_class,
        "subject": result.subject_label,
        "reference": result.reference_label,
        "not_covered": result.not_covered,
        "warnings": result.warnings, "rows": [_row_json(r) for r in rows],
                 "first_divergence": result.first_divergence}, indent=2) + "\n")
            (d / "report.md").write_text(_report_md(s, rows, man, run_id, passed, rerun))
            if plot and s.scope == "layer" and rows:
                _plot(d / "error_by_layer.png", s, rows)
        idx = staging / "index.md"
        idx.write_text(_index_md(result, man, run_id, rerun))
        (staging / "result.json").write_text(json.dumps(result.to_json(), indent=2, default=_json_default) + "\n")
        # move into place: every bundle, then the index last (its presence means the run completed)
        for s in specs:
            finals[s.id].parent.mkdir(parents=True, exist_ok=True)
            os.rename(staging / f"cp{s.id}_{s.name}", finals[s.id])
            written[s.id] = finals[s.id]
        json_path = out_dir / f"{run_id}.json"
        os.rename(staging / "result.json", json_path)
        os.rename(idx, index)                     # the run is complete from here on
        for p in written.values():
            (p / "INCOMPLETE").unlink()
    except OSError as e:
        raise OutputPathError(f"{out_dir}: could not write the bundles ({e.strerror or e}: "
                              f"{e.filename or ''})") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return {"index": index, "bundles": written}


def _json_default(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    raise TypeError(type(o).__name__)


def _index_md(result, man, run_id, rerun):
    fd = result.first_divergence
    n_nc = len({u["checkpoint"] for u in result.not_covered})
    verdict = ("DIVERGED" if fd is not None else "all checkpoints inside their bands" if not n_nc else
               f"every covered checkpoint inside its band; {n_nc} checkpoint(s) not (fully) covered")
    lines = [f"# Proof run {run_id}", "",
             f"Verdict: **{verdict}**; first divergence: "
             f"{'none' if fd is None else json.dumps(fd)}", "",
             f"- model `{man['model']}` (sha256 `{man['model_sha256']}`), band class `{result.band_class}`",
             f"- subject: {man['subject']}",
             f"- reference: {man['reference']} on `{man['reference_model']}`"
             + _settings_of(man["sides"].get("reference")),
             f"- prompt {json.dumps(result.prompt) if result.prompt else '(none: token ids given)'}: "
             f"{len(result.token_ids)} tokens",
             f"- llorch-ref {man['llorch_ref_version']} at {man['git_commit']}, numpy {man['numpy']}, "
             f"backend {man['backend']}, numerics {man['numerics']}, K/V cache {man['kv_dtype']}, "
             f"CPU flags: {man['cpu_flags']}",
             f"- weights: {'lazy' if man['weights'].get('lazy') else 'eager'}, {man['weights'].get('storage')}, "
             f"{man['weights'].get('dequantized_mb')} MB dequantized; peak resident memory of the run "
             f"{man['peak_rss_mb']:.0f} MB", "",
             "| checkpoint | name | comparisons | failed | worst NMSE | worst max abs | min cosine / agreement | band | bundle |",
             "|---|---|---|---|---|---|---|---|---|"]
    for s in result.summary():
        lines.append(f"| {s['checkpoint']} | {s['name']} | {s['rows']} | {s['failed']} | {fmt(s['worst_nmse'])} | "
                     f"{fmt(s['worst_max_abs'])} | {fmt_match(s) if s['passed'] is not None else 'NOT COVERED'} | "
                     f"`{json.dumps(s['band'])}` | "
                     f"[cp{s['checkpoint']}_{s['name']}/{run_id}](cp{s['checkpoint']}_{s['name']}/{run_id}/report.md) |")
    if result.greedy:
        g = result.greedy
        lines += ["", f"Greedy: {g['equal_prefix']}/{g['n']} tokens equal to {result.reference_label} (EOS ignored).",
                  "", f"{result.subject_label}: " + json.dumps(g["ours_text"] or g["ours"]), "",
                  f"{result.reference_label}: " + json.dumps(g["reference_text"] or g["reference"])]
    for w in result.warnings:
        lines += ["", f"Warning: {w}"]
    if result.not_covered:
        lines += ["", f"Not covered: {len(result.not_covered)} comparisons (not covered is not passed)."]
    lines += ["", "Re-run: `" + rerun + "`", ""]
    return "\n".join(lines)


def _plot(path, spec, rows):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for tensor in dict.fromkeys(r.tensor for r in rows):
        rs = [r for r in rows if r.tensor == tensor]
        ax.semilogy([r.layer for r in rs], [max(r.metrics.get("nmse", 0.0), 1e-20) for r in rs], marker="o",
                    ms=3, label=tensor)
    if "nmse" in rows[0].band:
        ax.axhline(rows[0].band["nmse"], color="red", ls="--", label="band")
    ax.set_xlabel("layer")
    ax.set_ylabel("NMSE vs reference")
    ax.set_title(f"checkpoint {spec.id}: {spec.title}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
