"""Proof bundles: one folder per run, everything a reviewer, a CI system or a third party needs.

    <out>/<run_id>/
      report.html              self-contained (inline figures, no network): verdict, the first divergence's card,
                               error by layer of every checkpoint, settings and versions
      summary.md               verdict and one row per checkpoint (the CI step summary: $GITHUB_STEP_SUMMARY)
      junit.xml                one test case per checkpoint, layer, tensor and step
      result.json              every comparison's figures
      manifest.json            versions, settings, how to re-run the reference (recipe), the sha256 of every file
      cp<id>_<name>/           report.md, report.json, subject.npz, reference.npz, error_by_layer.png
      repro/                   the first divergence as a standalone pytest case (when one diverges)
      trace.json, trace.npz,   a black-box engine's run and the per-step table (bundle_blackbox.py)
      steps.md

Every page states the verdict where `verify` reads it: result.json's "verdict" (and each row's `order`),
summary.md's line `**Verdict: STATUS**`, junit.xml's testsuite property llorch.verdict, report.html's element
id="verdict" (data-verdict); the manifest says what the verdict requires and whether repro/ is held.

The run is written into a staging folder beside it and renamed into place when complete: a run folder
exists exactly when the run completed; a run id that exists is refused, never overwritten. Paths under
$LLORCH_HOME, the home folder or the current folder are written as `$LLORCH_HOME/...`, `~/...` or relative.
"""
from __future__ import annotations

import base64
import dataclasses
import datetime as _dt
import hashlib
import json
import os
import platform
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np

from ..backends import cpu_flags, cpu_model
from ..dump import model_sha256
from ..errors import HarnessError, OutputPathError, ParameterError
from ..output_paths import check_container, check_output, check_run_id
from ..tensor_file import write_npz
from . import bundle_blackbox, bundle_md, junit, plots, report_html, repro
from .portable import portable

MANIFEST = "manifest.json"
SIGNATURE = "manifest.json.sig"  # prove --sign: an Ed25519 signature of manifest.json's bytes
FORMAT = "llorch-proof/3"        # /3: every page carries the verdict where `verify` reads it; rows keep their order


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


def _dist_version(name):
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def runtime_versions(engine) -> dict:
    """What ran the llorch-ref side: numba where the numba backend ran, CuPy, the CUDA runtime and driver and
    the GPU where the cupy backend ran (absent otherwise)."""
    out = {}
    name = engine.backend.name if engine is not None else None
    if name == "numba":
        out["numba"] = _dist_version("numba")
    if name == "cupy":
        import cupy
        rt = cupy.cuda.runtime
        ver = lambda v: f"{v // 1000}.{v % 1000 // 10}"              # 13020 -> "13.2"
        out.update(cupy=cupy.__version__, cuda_runtime=ver(rt.runtimeGetVersion()),
                   cuda_driver=ver(rt.driverGetVersion()), gpu=rt.getDeviceProperties(0)["name"].decode())
    return out


def manifest(result, engine, argv, seed=0) -> dict:
    import gguf

    import llorch_ref

    try:
        import llama_cpp
        lcp = llama_cpp.__version__
        sysinfo = llama_cpp.llama_print_system_info().decode()
    except ImportError:
        lcp, sysinfo = None, None
    ref_sha, model_sha = (model_sha256(p) if Path(p).exists() else "unknown (not a file)"
                          for p in (result.reference_model, result.model))
    return portable({
        "format": FORMAT,
        "llorch_ref_version": llorch_ref.__version__,
        "git_commit": _git_commit(),
        "python": sys.version.split()[0],
        "numpy": np.__version__,
        "gguf": getattr(gguf, "__version__", None) or _dist_version("gguf"),
        "llama_cpp_python": lcp,
        "llama_cpp_system_info": sysinfo,
        **runtime_versions(engine),
        "cpu_model": cpu_model(),
        "cpu_flags": cpu_flags(),
        "machine": platform.machine(),
        "model": result.model,
        "model_sha256": model_sha,
        "reference_model": result.reference_model,
        "reference_model_sha256": ref_sha,
        "n_layers": engine.config.n_layers,
        "local_layers": list(engine.config.local_layers) if engine.config.local_layers else None,
        "band_class": result.band_class,
        "subject": result.subject_label,
        "reference": result.reference_label,
        "backend": engine.backend.name,
        "numerics": engine.numerics,
        "ggml_simd": engine.ggml_simd,
        "kv_dtype": engine.kv_dtype,
        "device": engine.backend.device,
        "weights": engine.weights_info(),
        "peak_rss_mb": round(_peak_rss_mb(), 1),
        "prompt": result.prompt,
        "token_ids": result.token_ids,
        "sides": result.sides,
        "recipe": result.recipe,
        "seed": seed,
        "command": " ".join(argv),
        "created_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(),
    })


def _peak_rss_mb() -> float:
    """Peak resident memory of this process so far (Linux ru_maxrss is in KiB); includes mapped file pages."""
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def file_hashes(folder: Path) -> dict:
    """{relative path: sha256} of every file under folder but the manifest itself."""
    return {p.relative_to(folder).as_posix(): sha256_of(p) for p in sorted(folder.rglob("*"))
            if p.is_file() and p.relative_to(folder).as_posix() != MANIFEST}


def check_bundle_target(out_dir=None, run_id=None) -> tuple[Path, str]:
    """-> (out_dir, run_id), checked before any work: the folder is one (or can be made), the run id is a
    safe file name, no run of that id is there (bundles are never overwritten), and $GITHUB_STEP_SUMMARY
    can be appended to (check_step_summary)."""
    out_dir = check_container(out_dir or default_dir(), what="--out")
    run_id = check_run_id(run_id or default_run_id())
    if os.path.lexists(out_dir / run_id):
        _refuse_taken(out_dir, run_id)
    check_step_summary()
    return out_dir, run_id


def _refuse_taken(out_dir: Path, run_id: str):
    """A run id that exists is refused with what to do: bundles are never overwritten, and prove has no
    --overwrite."""
    raise HarnessError(f"run id {run_id!r} already exists ({out_dir / run_id}); bundles are never overwritten: "
                       f"pick another --run-id (or LLORCH_RUN_ID), or remove that folder first")


def check_step_summary() -> Path | None:
    """$GITHUB_STEP_SUMMARY, where set, is a regular file or a name in an existing folder: the summary is
    appended to it after the bundle is complete, so a folder, FIFO or device there is refused ahead of the run
    (OutputPathError). -> the path, or None when unset."""
    step = os.environ.get("GITHUB_STEP_SUMMARY")
    if not step:
        return None
    p = Path(step)
    try:
        st = os.stat(p)
    except FileNotFoundError:
        if not p.parent.is_dir():
            raise OutputPathError(f"GITHUB_STEP_SUMMARY={step}: no such folder {p.parent}: the step summary cannot "
                                  f"be written (unset it or point it at a file)") from None
        return p
    except OSError as e:
        raise OutputPathError(f"GITHUB_STEP_SUMMARY={step}: cannot be read ({e.strerror})") from None
    if not stat.S_ISREG(st.st_mode):
        kind = "a folder" if stat.S_ISDIR(st.st_mode) else "not a regular file (a FIFO, device or socket)"
        raise OutputPathError(f"GITHUB_STEP_SUMMARY={step} is {kind}: the step summary is appended to a file "
                              f"(unset it or point it at a file)")
    return p


def append_step_summary(text: str):
    """The CI's own file ($GITHUB_STEP_SUMMARY, check_step_summary's rule): appended to, never replaced."""
    p = check_step_summary()
    if p is None:
        return
    try:
        with open(p, "a") as f:
            f.write(text)
    except OSError as e:
        raise OutputPathError(f"GITHUB_STEP_SUMMARY={p}: the bundle is complete, but the step summary could not "
                              f"be appended ({e.strerror or e})") from None


def write_bundle(result, engine, out_dir=None, run_id=None, argv=None, seed=0, plot=True, repro_case=True,
                 tensors=True, sign=None, trace=None) -> dict:
    """-> {"dir", "summary", "html", "junit", "repro" (or None)}: the run's folder and its main files.
    engine: the llorch-ref engine of the run (the subject of a llama.cpp diff, the reference of a dump's).
    tensors: keep both sides' tensors (subject.npz, reference.npz); without them a bundle is small (examples,
    CI artifacts) but `verify` can check its hashes only, not redo its figures. sign: an Ed25519 private key
    (load_signing_key) or its PEM file: manifest.json is signed (manifest.json.sig). trace: a black-box engine's
    run (references/blackbox.py) that result compared: kept as the subject's side (bundle_blackbox.py), with the
    per-step table, and the recipe re-runs the reference on it."""
    key = load_signing_key(sign) if isinstance(sign, (str, os.PathLike)) else sign
    out_dir, run_id = check_bundle_target(out_dir, run_id)
    argv = list(argv or sys.argv)
    if trace is not None:
        result = dataclasses.replace(result, recipe=bundle_blackbox.recipe(engine, trace))
    man = manifest(result, engine, argv, seed)
    result = dataclasses.replace(result, **portable({k: getattr(result, k) for k in (
        "warnings", "not_covered", "subject_label", "reference_label", "model", "reference_model", "recipe")}))
    target = check_output(out_dir / run_id, kind="folder", what="bundle", make_parents=True)
    specs = [s for s in result.specs if any(r.checkpoint == s.id for r in result.rows)
             or any(u["checkpoint"] == s.id for u in result.not_covered)]
    plot_off = None if plot else "Plots not drawn (written with --no-plots)."
    plot = plot and plots.available()
    try:
        case = _stage(target, out_dir, run_id, result, engine, man, specs, plot, plot_off, tensors, repro_case, key,
                      trace)
    except OutputPathError:
        if os.path.lexists(out_dir / run_id):        # another prove of this run id wrote it meanwhile
            _refuse_taken(out_dir, run_id)
        raise
    append_step_summary(bundle_md.summary(result, man, run_id, specs, links=False) + "\n")
    run = out_dir / run_id
    return {"dir": run, "summary": run / "summary.md", "html": run / "report.html", "junit": run / "junit.xml",
            "repro": run / "repro" if case else None}


def _stage(target, out_dir, run_id, result, engine, man, specs, plot, plot_off, tensors, repro_case, key, trace):
    """Every file of the bundle into a staging folder, renamed into place when complete (staged_folder);
    -> the repro's case (repro.write) or None."""
    with target.staged_folder() as d:
        if trace is not None:
            bundle_blackbox.write_trace(d, trace)
            (d / bundle_blackbox.STEPS_MD).write_text(bundle_blackbox.steps_md(result, run_id))
        svgs = {s.id: _write_checkpoint(d / bundle_md.checkpoint_folder(s), s, result, man, plot, tensors)
                for s in specs}
        case = repro.write(d / "repro", result, engine, {**man, "run_id": run_id}) if repro_case else None
        (d / "result.json").write_text(json.dumps(portable(result_json(result)), indent=2, default=_json_default)
                                       + "\n")
        (d / "summary.md").write_text(bundle_md.summary(result, man, run_id, specs))
        (d / "junit.xml").write_text(junit.xml(result, run_id))
        (d / "report.html").write_text(report_html.render(result, man, run_id, engine, case, plot=plot,
                                                          layer_svgs={k: v for k, v in svgs.items() if v},
                                                          plot_off=plot_off))
        (d / MANIFEST).write_text(json.dumps({**man, "run_id": run_id, "checkpoints": [s.id for s in specs],
                                              "tensors": tensors, "require": result.require,
                                              "repro": repro_entry(result, case, repro_case),
                                              "files": file_hashes(d)}, indent=2) + "\n")
        if key is not None:
            sign_manifest(d, key)
        if os.path.lexists(out_dir / run_id):
            _refuse_taken(out_dir, run_id)
    return case


def ed25519_modules():
    """cryptography's Ed25519 and PEM serialization (an optional dependency: signing only)."""
    try:
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import ed25519
    except ImportError:
        raise ParameterError("signing needs the cryptography package (pip install cryptography)") from None
    return ed25519, serialization


def load_signing_key(path):
    """The Ed25519 private key of `prove --sign KEYFILE`: a PEM file, unencrypted PKCS#8 (`openssl genpkey
    -algorithm ed25519 -out key.pem`)."""
    ed25519, serialization = ed25519_modules()
    try:
        key = serialization.load_pem_private_key(Path(path).read_bytes(), password=None)
    except (OSError, ValueError, TypeError) as e:
        raise ParameterError(f"--sign {path}: not an unencrypted PEM private key ({type(e).__name__}: {e})") from None
    if not isinstance(key, ed25519.Ed25519PrivateKey):
        raise ParameterError(f"--sign {path}: a {type(key).__name__}, not an Ed25519 key (openssl genpkey "
                             f"-algorithm ed25519)")
    return key


def public_key_id(raw: bytes) -> str:
    """A public key's name: the sha256 of its 32 raw bytes."""
    return hashlib.sha256(raw).hexdigest()


def sign_manifest(folder: Path, key) -> dict:
    """manifest.json.sig beside the manifest: the Ed25519 signature of manifest.json's bytes (which hold the
    sha256 of every other file) and the signer's public key (its id: public_key_id). -> what it wrote."""
    _, serialization = ed25519_modules()
    raw = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    sig = {"algorithm": "ed25519", "signed": MANIFEST, "public_key": base64.b64encode(raw).decode(),
           "public_key_sha256": public_key_id(raw),
           "signature": base64.b64encode(key.sign((folder / MANIFEST).read_bytes())).decode()}
    (folder / SIGNATURE).write_text(json.dumps(sig, indent=2) + "\n")
    return sig


def result_json(result) -> dict:
    """result.json: DiffResult.to_json() with each row's place in the first-divergence order (`order`), so the
    first divergence can be named again from the rows alone (verify does)."""
    out = result.to_json()
    for j, r in zip(out["rows"], result.rows):
        j["order"] = list(r.order)
    if bundle_blackbox.is_blackbox(result):
        out["blackbox"] = bundle_blackbox.steps_json(result)
    return out


def repro_entry(result, case, repro_case: bool) -> dict | None:
    """The manifest's word on repro/: None where nothing diverges, {"written": True}, or {"written": False,
    "why"} (no repro can be made of this divergence, or write_bundle asked for none)."""
    if result.first_divergence is None:
        return None
    if not repro_case:
        return {"written": False, "why": "written without a repro (write_bundle repro_case=False)"}
    return {"written": True} if case and case["written"] else {"written": False, "why": (case or {}).get("why")}


def _write_checkpoint(d: Path, spec, result, man, plot, tensors=True) -> str | None:
    """One checkpoint's folder; -> its error-by-layer figure as SVG for the page (drawn once: PNG and SVG)."""
    d.mkdir()
    rows = [r for r in result.rows if r.checkpoint == spec.id]
    pre = f"cp{spec.id}."
    if tensors:
        for name, caps in (("subject.npz", result.captures_ours), ("reference.npz", result.captures_ref)):
            # one tensor read (a long run's from its dump on disk) and written at a time
            write_npz(d / name, ((k, caps[k]) for k in list(caps.keys()) if k.startswith(pre)))
    passed = bool(rows) and not any(r.diverges for r in rows)       # the local error decides where measured
    drawn = plot and spec.scope == "layer" and any("nmse" in r.metrics for r in rows)
    (d / "report.json").write_text(json.dumps(
        {"checkpoint": spec.id, "name": spec.name, "title": spec.title, "passed": passed,
         "band_class": result.band_class, "subject": result.subject_label, "reference": result.reference_label,
         "not_covered": [u for u in result.not_covered if u["checkpoint"] == spec.id],
         "warnings": result.warnings, "rows": [bundle_md.row_json(r) for r in rows],
         "first_divergence": result.first_divergence}, indent=2, default=_json_default) + "\n")
    missing = [u for u in result.not_covered if u["checkpoint"] == spec.id]
    (d / "report.md").write_text(bundle_md.checkpoint(spec, rows, man, passed, missing,
                                                      plot="error_by_layer.png" if drawn else None, tensors=tensors))
    if not drawn:
        return None
    fig = report_html.layer_figure(spec, rows, man["local_layers"], figsize=(7, 3.5))
    plots.save(fig, d / "error_by_layer.png", close=False)
    return plots.svg(fig)


def _json_default(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    raise TypeError(type(o).__name__)
