"""Verify a proof bundle, in this order:

1. Walk it without following a link: a symbolic link (to a file or a folder) or anything but a regular file or
   folder is refused (HarnessError, exit 2), so nothing outside the bundle is read.
2. Every file against the sha256 its manifest holds (an edited, missing or added file is named).
3. Code: a bundle holds one code file, repro/test_repro.py, exactly as llorch-ref writes it from the bundle's
   repro/case.json (repro.repro_test_source); any other code file (*.py, conftest.py, *.pyc, *.sh, pytest.ini,
   setup.cfg, tox.ini, pyproject.toml, an executable) or a test_repro.py that differs by a byte is refused.
4. The verdict of result.json's own rows (each row's divergence from its flags, Row.diverges; the first
   divergence by the rows' order; the required coverage) against every page that states one: result.json's
   verdict, passed and first_divergence, summary.md's verdict line, heading and table, junit.xml's failures
   and its llorch.verdict property, report.html's element id="verdict", each checkpoint's report.json and
   report.md, and repro/ (held where the first divergence has one).
5. The manifest against the files: "tensors": false while tensor files are present is a contradiction; the
   re-run is decided by the tensors present, never by the flag alone.
6. The reference side run again from the manifest alone (its recipe: model file and sha256, token ids,
   settings) and the comparison redone on the subject's tensors the bundle keeps: the figures hold when every
   comparison keeps its verdict, and the re-run's verdict (status, first divergence) is the rows' verdict. The
   re-run reference's tensors are compared with the ones the bundle keeps (bit-equal on the machine and build
   that wrote it; a few ulps apart elsewhere), and the largest change of any figure is printed.

sha256 detects accidental edits, not forgery: whoever edits a bundle can recompute every hash, and pages that
agree with edited rows agree. The re-run checks the figures against the reference; only a signature would tie
the files to their writer.
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import os
import re
import stat
import types
import xml.etree.ElementTree as ET
import zipfile
import zlib
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path

import numpy as np

from ..checkpoints import load_specs
from ..dump import (
    CANONICAL_LAYOUTS,
    NAME_RE,
    Dump,
    catalogue,
    expected_shape,
    model_sha256,
    split_step,
    validate_manifest,
)
from ..errors import HarnessError, ParameterError
from ..json_doc import check_schema, parse_json
from ..loaders.lazy_weights import mem_available
from ..references.engines import dump_llamacpp, dump_transformers, gguf_config
from ..references.llorch import record_engine
from ..tensor_file import NpzTensors
from .blackbox import RUN, compare_trace
from .bundle import FORMAT, MANIFEST, SIGNATURE, ed25519_modules, public_key_id
from .bundle_blackbox import TRACE_JSON, read_trace
from .bundle_md import checkpoint_folder
from .compare import compare_dumps, dims_of
from .junit import _case_name
from .metrics import compare, within
from .portable import expand_path
from .repro import check_names, repro_test_source
from .result import DiffResult, Row
from .run import backend_bands, comparison_bytes
from .verdict import FAIL, INCOMPLETE, PASS, Verdict, verdict_of

HASH_CAVEAT = ("sha256 detects accidental edits, not forgery: whoever edits a bundle can recompute every hash "
               "(and make its pages agree with edited rows); the re-run checks the figures against the reference, "
               "a signature checked against the writer's key (prove --sign KEYFILE, verify --key PUBKEY) ties the "
               "files to that key")
CODE_NAMES = {"conftest.py", "pytest.ini", "setup.cfg", "tox.ini", "pyproject.toml", "setup.py", "noxfile.py",
              "Makefile", "justfile"}
CODE_SUFFIXES = (".py", ".pyc", ".pyo", ".pyw", ".pyd", ".pth", ".so", ".sh", ".bash", ".zsh", ".bat", ".cmd",
                 ".ps1", ".ipynb")
TEST_REPRO = "repro/test_repro.py"
PAGE_LIMIT = 64 << 20          # a page or manifest past this is refused unread (llorch-ref's are far smaller)
NPY_HEADER = 1 << 16           # an .npy member's header and padding: numpy's own limit is 10,000 bytes
RERUN_SHARE = 0.8              # the re-run may take this share of MemAvailable (run.check_memory's rule)
REFERENCE_NMSE = 1e-6          # a kept reference tensor against the re-run's: a few ulps apart is ~1e-14

_SHA = {"type": "string", "pattern": "^[0-9a-f]{64}$"}
_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}}
_TEXT = {"type": ["string", "null"]}
_NUMBERS = {"type": ["object", "null"], "additionalProperties": {"type": ["number", "null"]}}
RECIPE_SCHEMA = {
    "type": "object", "required": ["kind", "model", "model_sha256", "token_ids", "n_greedy"],
    "properties": {
        "kind": {"enum": ["llamacpp", "llorch", "transformers", "blackbox"]},
        "model": {"type": "string", "minLength": 1}, "trace": {"const": "trace.npz"},
        "model_sha256": _SHA, "token_ids": {**_IDS, "minItems": 1}, "prompt": _TEXT,
        "n_greedy": {"type": "integer", "minimum": 0}, "rows": {"type": ["array", "null"], "items": _IDS["items"]},
        "checkpoints": {"type": ["array", "null"], "items": {"type": "string"}},
        "kv_dtype": {"type": "string"}, "n_ubatch": {"type": "integer", "minimum": 1},
        "n_batch": {"type": "integer", "minimum": 1}, "n_gpu_layers": {"type": "integer", "minimum": 0},
        "backend": {"type": "string"}, "numerics": {"type": "string"}, "ggml_simd": _TEXT,
        "decode_ids": {"type": ["array", "null"], "items": _IDS["items"]}, "local": {"type": "boolean"},
        "backend_band": _NUMBERS, "require": {"type": ["string", "array", "null"], "items": {"type": "string"}}},
    "allOf": [{"if": {"properties": {"kind": {"enum": ["llorch", "blackbox"]}}},
               "then": {"required": ["backend", "numerics", "kv_dtype"]}},
              {"if": {"properties": {"kind": {"const": "llamacpp"}}}, "then": {"required": ["kv_dtype"]}}]}
FILES_SCHEMA = {"type": "object", "required": ["files", "recipe"],
                "properties": {"files": {"type": "object", "additionalProperties": _SHA}}}
MANIFEST_SCHEMA = {
    "type": "object", "required": ["format", "files", "recipe", "checkpoints", "sides", "band_class"],
    "properties": {
        **FILES_SCHEMA["properties"], "format": {"type": "string"},
        "recipe": {"anyOf": [{"type": "null"}, RECIPE_SCHEMA]},
        "checkpoints": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 64},
        "sides": {"type": "object", "required": ["subject"], "properties": {"subject": {"type": "object"}}},
        "tensors": {"type": "boolean"}, "band_class": _TEXT, "subject": _TEXT, "reference": _TEXT,
        "model": _TEXT, "model_sha256": _TEXT, "require": RECIPE_SCHEMA["properties"]["require"],
        "repro": {"type": ["object", "null"], "properties": {"written": {"type": "boolean"}, "why": _TEXT}}}}
ROW_SCHEMA = {
    "type": "object", "required": ["checkpoint", "tensor", "order"],
    "properties": {
        "checkpoint": {"type": "string"}, "tensor": {"type": "string"}, "name": {"type": "string"},
        "layer": {"type": ["integer", "null"], "minimum": 0}, "step": {"type": ["integer", "null"], "minimum": 0},
        "order": {"type": "array", "items": {"type": "number"}, "minItems": 1},
        "band": _NUMBERS, "local_band": _NUMBERS, "local": {"type": ["object", "null"]},
        "passed": {"type": "boolean"}, "local_passed": {"type": ["boolean", "null"]},
        "local_covers": {"type": ["boolean", "null"]}, "diverges": {"type": "boolean"},
        **{k: {"type": ["number", "null"]} for k in ("nmse", "max_abs", "cosine", "agreement", "equal_prefix",
                                                     "max_rel")}}}
RESULT_SCHEMA = {
    "type": "object", "required": ["rows"],
    "properties": {"rows": {"type": "array", "items": ROW_SCHEMA},
                   "not_covered": {"type": ["array", "null"], "items": {"type": "object"}},
                   "verdict": {"type": ["object", "null"]}, "first_divergence": {"type": ["object", "null"]},
                   "band_class": _TEXT, "passed": {"type": ["boolean", "null"]}}}


@dataclass
class Verification:
    folder: str
    n_files: int = 0
    edited: list = field(default_factory=list)      # files whose sha256 changed
    missing: list = field(default_factory=list)     # files the manifest lists that are gone
    added: list = field(default_factory=list)       # files the manifest does not list
    refused: list = field(default_factory=list)     # ["path: why"]: code files llorch-ref would not write
    contradictions: list = field(default_factory=list)   # ["page: what"]: a page against the rows' verdict
    manifest_faults: list = field(default_factory=list)  # ["manifest.json: what"]: the manifest against the files
    notes: list = field(default_factory=list)       # lines a reader must see that are not failures
    verdict: dict | None = None                     # the rows' verdict (Verdict.to_json()) and its lines
    model: dict = field(default_factory=dict)       # the reference's model file: path, sha256, whether re-run
    subject_model: dict = field(default_factory=dict)
    band_class: str | None = None
    rerun: dict | None = None                       # the re-run's findings (None: not re-run)
    signature: dict = field(default_factory=dict)   # {"signed", "checked", "good", "signer", "why"}

    @property
    def files_ok(self) -> bool:
        return not (self.edited or self.missing or self.added)

    @property
    def ok(self) -> bool:
        return (self.files_ok and not self.refused and not self.contradictions and not self.manifest_faults
                and self.signature.get("good") is not False
                and (self.rerun is None or self.rerun["figures_hold"] is not False))

    def to_json(self) -> dict:
        return {"folder": self.folder, "ok": self.ok, "files_ok": self.files_ok, "edited": self.edited,
                "missing": self.missing, "added": self.added, "refused": self.refused,
                "contradictions": self.contradictions, "manifest_faults": self.manifest_faults, "notes": self.notes, "verdict": self.verdict,
                "model": self.model, "subject_model": self.subject_model, "band_class": self.band_class,
                "hashes": HASH_CAVEAT, "signature": self.signature, "rerun": self.rerun}


# -- 1. the walk --------------------------------------------------------------------------------------------
def scan_bundle(folder) -> dict:
    """{relative path: lstat} of every regular file under folder, never following a link. A symbolic link
    anywhere (the folder itself included), or a FIFO, socket or device, is refused with a HarnessError:
    llorch-ref writes none, and following one would read outside the bundle."""
    folder = Path(folder)
    if os.path.islink(folder):
        raise HarnessError(f"{folder}: the bundle folder is a symbolic link: verify never follows links (pass the "
                           f"folder it points to)")
    if not folder.is_dir():
        raise HarnessError(f"{folder}: no such bundle folder (a run's folder: <out>/<run_id>/)")
    files = {}
    _scan(folder, "", files)
    return files


def _scan(top: Path, rel: str, files: dict):
    """One folder of the walk (scan_bundle's rule), entries in name order."""
    with os.scandir(top / rel if rel else top) as it:
        entries = sorted(it, key=lambda e: e.name)
    for e in entries:
        name = f"{rel}/{e.name}" if rel else e.name
        st = e.stat(follow_symlinks=False)
        if stat.S_ISLNK(st.st_mode):
            raise HarnessError(f"{top / name}: a symbolic link in the bundle (to {os.readlink(e.path)}): verify "
                               f"never follows links and refuses the bundle")
        if stat.S_ISDIR(st.st_mode):
            _scan(top, name, files)
        elif stat.S_ISREG(st.st_mode):
            files[name] = st
        else:
            raise HarnessError(f"{top / name}: not a regular file or folder (a FIFO, socket or device): refused")


def sha256_nofollow(path: Path) -> str:
    """The sha256 of a regular file, opened without following a link (O_NOFOLLOW)."""
    h = hashlib.sha256()
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    with os.fdopen(fd, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _read_text(folder: Path, files: dict, name: str) -> str | None:
    """A file of the walk as text (None when absent or not UTF-8); a page past PAGE_LIMIT bytes is refused
    unread (HarnessError)."""
    if name not in files:
        return None
    if files[name].st_size > PAGE_LIMIT:
        raise HarnessError(f"{folder / name}: {files[name].st_size / 2**20:.0f} MiB, over the {PAGE_LIMIT >> 20} MiB a "
                           f"bundle's page may take: not a page llorch-ref writes")
    try:
        return (folder / name).read_text()
    except UnicodeDecodeError:
        return None


def _read_json(folder: Path, files: dict, name: str):
    """A page as JSON; None when absent, not UTF-8 or not JSON (the page is then named as missing)."""
    text = _read_text(folder, files, name)
    try:
        return None if text is None else parse_json(text, folder / name, HarnessError)
    except HarnessError:
        return None


# -- 2. manifest and hashes ---------------------------------------------------------------------------------
def read_manifest(folder, files=None) -> dict:
    folder = Path(folder)
    files = scan_bundle(folder) if files is None else files
    p = folder / MANIFEST
    if MANIFEST not in files:
        raise HarnessError(f"{folder}: no {MANIFEST}: not a proof bundle (or one written before format "
                           f"llorch-proof/2, which kept no hashes)")
    if files[MANIFEST].st_size > PAGE_LIMIT:
        raise HarnessError(f"{p}: {files[MANIFEST].st_size / 2**20:.0f} MiB, over the {PAGE_LIMIT >> 20} MiB a "
                           f"manifest may take: not a llorch-proof manifest")
    try:
        text = p.read_text()
    except UnicodeDecodeError as e:
        raise HarnessError(f"{p}: not UTF-8 ({e}): the manifest itself is damaged") from None
    man = parse_json(text, p, HarnessError)
    if not isinstance(man, dict) or not isinstance(man.get("files"), dict) or "recipe" not in man:
        raise HarnessError(f"{p}: no 'files' and 'recipe': not a llorch-proof manifest")
    check_schema(man, MANIFEST_SCHEMA if man.get("format") == FORMAT else FILES_SCHEMA, p, HarnessError)
    return man


def check_files(folder, man, files=None) -> Verification:
    """Every listed file against its sha256; the files present that the manifest does not list."""
    folder = Path(folder)
    files = scan_bundle(folder) if files is None else files
    now = {n: sha256_nofollow(folder / n) for n in files if n not in (MANIFEST, SIGNATURE)}
    v = Verification(folder=str(folder), n_files=len(man["files"]))
    for name, sha in sorted(man["files"].items()):
        if name not in now:
            v.missing.append(name)
        elif now[name] != sha:
            v.edited.append(name)
    v.added = sorted(set(now) - set(man["files"]))
    return v


# -- signature ----------------------------------------------------------------------------------------------
def load_public_key(path):
    """The Ed25519 public key of `verify --key PUBKEY`: a PEM file (`openssl pkey -in key.pem -pubout -out
    key.pub`)."""
    ed25519, serialization = ed25519_modules()
    try:
        key = serialization.load_pem_public_key(Path(path).read_bytes())
    except (OSError, ValueError, TypeError) as e:
        raise ParameterError(f"--key {path}: not a PEM public key ({type(e).__name__}: {e})") from None
    if not isinstance(key, ed25519.Ed25519PublicKey):
        raise ParameterError(f"--key {path}: a {type(key).__name__}, not an Ed25519 public key")
    return key


def check_signature(folder: Path, files: dict, key_path=None) -> dict:
    """manifest.json.sig against manifest.json's bytes under the key given (never the key the bundle carries:
    anyone can sign with a key of their own). Without a key: whether the bundle is signed, and by which key id.
    -> {"signed", "checked", "good" (None: not checked), "signer", "why"}."""
    sig = _read_json(folder, files, SIGNATURE) if SIGNATURE in files else None
    signed = isinstance(sig, dict)
    out = {"signed": signed, "checked": key_path is not None, "good": None,
           "signer": sig.get("public_key_sha256") if signed else None, "why": None}
    if key_path is None:
        return out
    _, serialization = ed25519_modules()
    key = load_public_key(key_path)
    given = public_key_id(key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw))
    out["key"] = given
    if not signed:
        return {**out, "good": False, "why": f"no readable {SIGNATURE}: the bundle is not signed"}
    from cryptography.exceptions import InvalidSignature  # installed: load_public_key imported cryptography

    try:
        key.verify(base64.b64decode(str(sig.get("signature")), validate=True), (folder / MANIFEST).read_bytes())
    except (ValueError, binascii.Error):
        return {**out, "good": False, "why": f"{SIGNATURE} is not a signature"}
    except InvalidSignature:
        other = out["signer"] not in (None, given)
        return {**out, "good": False, "why": f"{MANIFEST} does not carry a signature of key {given[:16]}…"
                + (f" (the signature names key {str(out['signer'])[:16]}…)" if other else
                   " (edited after signing)")}
    return {**out, "good": True, "why": f"{MANIFEST} (and through its sha256 every file) signed by key {given[:16]}…"}


# -- 3. code ------------------------------------------------------------------------------------------------
def is_code(name: str, st) -> bool:
    """A file a Python tool, a shell or pytest could run or load: by name (conftest.py, pytest.ini, setup.cfg,
    tox.ini, pyproject.toml, ...), by suffix (.py, .pyc, .sh, .so, .pth, ...), inside __pycache__, or
    executable by anyone."""
    base = name.rsplit("/", 1)[-1]
    return (base in CODE_NAMES or base.endswith(CODE_SUFFIXES) or "__pycache__" in name.split("/")
            or bool(st.st_mode & 0o111))


def refused_code(folder: Path, files: dict) -> list[str]:
    """Code files llorch-ref would not write for this bundle: anything is_code but repro/test_repro.py, and a
    test_repro.py that is executable or differs by a byte from repro_test_source(its case.json)."""
    out = []
    for name, st in files.items():
        if not is_code(name, st):
            continue
        if name != TEST_REPRO or st.st_mode & 0o111:
            out.append(f"{name}: llorch-ref writes no such file (a bundle's only code is {TEST_REPRO}, "
                       f"not executable)")
            continue
        case = _read_json(folder, files, "repro/case.json")
        if not isinstance(case, dict):
            out.append(f"{name}: no readable repro/case.json to write it again from")
        elif (folder / name).read_bytes() != repro_test_source(case).encode():
            out.append(f"{name}: differs from the test_repro.py llorch-ref writes for this case.json")
    return out


# -- 4. the rows' verdict against every page ----------------------------------------------------------------
def _row(r: dict) -> Row:
    """A row of result.json as a Row (its flags, band and order; no figures), so Row.diverges and
    DiffResult.first_divergence apply their own rule to it."""
    return Row(checkpoint=str(r["checkpoint"]), name=r.get("name", ""), layer=r.get("layer"), tensor=r["tensor"],
               metrics={}, band=r.get("band") or {}, passed=r.get("passed") is True, order=tuple(r.get("order") or ()),
               local=r.get("local"), local_band=r.get("local_band"), local_passed=r.get("local_passed"),
               local_covers=r.get("local_covers", True) is not False, step=r.get("step") or 0)


def rows_of(stored: dict) -> DiffResult:
    """result.json's rows and not-covered cases as a DiffResult (what verdict_of_rows judges)."""
    try:
        rows = [_row(r) for r in stored["rows"]]
        nc = list(stored.get("not_covered") or [])
    except (KeyError, TypeError, AttributeError) as e:
        raise HarnessError(f"result.json: a row without {e}: not a comparison's result") from None
    if any(not r.order for r in rows):
        raise HarnessError(f"result.json: a row without its order (format {FORMAT} keeps it): its first divergence "
                           f"cannot be named again")
    return DiffResult(model="", reference_model="", prompt="", token_ids=[], band_class=stored.get("band_class"),
                      rows=rows, not_covered=nc, local_declaration=stored.get("local_declaration"))


def verdict_of_rows(stored: dict) -> Verdict:
    """The verdict result.json's own rows give, by judge's rule (harness/verdict.py): FAIL where a row diverges
    (Row.diverges: local_passed False diverges; local_passed True with local_covers does not; else not passed
    does), the first divergence by the rows' order; INCOMPLETE where nothing is compared, a required key (the
    list the bundle's verdict names: a re-run derives it again from the model) is not compared on every
    layer, or a declared decode step holds nothing; PASS otherwise."""
    res = rows_of(stored)
    sv = stored.get("verdict") if isinstance(stored.get("verdict"), dict) else {}
    return verdict_of(res, [str(k) for k in sv.get("required") or []], str(sv.get("rule") or "not known"))


def _checkpoint_verdicts(res: DiffResult, specs) -> dict:
    """{checkpoint id: PASS | FAIL | NOT COVERED} of the rows: compared and none diverges is PASS."""
    out = {}
    for s in specs:
        rows = [r for r in res.rows if r.checkpoint == s.id]
        out[s.id] = "NOT COVERED" if not rows else ("FAIL" if any(r.diverges for r in rows) else "PASS")
    return out


def _check_result_json(stored: dict, res: DiffResult, v: Verdict) -> list[str]:
    """result.json's own verdict, passed and first divergence, and each row's `diverges`, against its rows."""
    out = []
    sv = stored.get("verdict") if isinstance(stored.get("verdict"), dict) else {}
    if sv.get("status") != v.status:
        out.append(f"its verdict says {sv.get('status')}, its rows give {v.status}")
    if sv.get("first_divergence") != v.first_divergence or stored.get("first_divergence") != v.first_divergence:
        out.append(f"its first divergence is {stored.get('first_divergence')}, its rows give {v.first_divergence}")
    if stored.get("passed") is not (v.status == PASS):
        out.append(f"passed is {stored.get('passed')}, its rows give {v.status}")
    bad = [r for r, j in zip(res.rows, stored["rows"]) if j.get("diverges") is not r.diverges]
    if bad:
        out.append(f"{len(bad)} rows' diverges flag disagrees with their own pass flags (first: cp{bad[0].checkpoint} "
                   f"{bad[0].tensor} L{bad[0].layer})")
    flags = [j for j in stored["rows"] if not _flags_hold(j)]
    if flags:
        out.append(f"{len(flags)} rows' pass flags disagree with their own figures against their bands (first: "
                   f"cp{flags[0]['checkpoint']} {flags[0]['tensor']} L{flags[0].get('layer')})")
    return out


def _flags_hold(j: dict) -> bool:
    """A row's passed and local_passed are its figures against its bands (metrics.within), as compare wrote them."""
    figures = {k: x for k, x in j.items() if k not in ("band", "passed")}
    band = j.get("band") or {}
    if "near_tie" in band:          # a black-box step's argmax (harness/blackbox.py): the same top, or a near tie
        margin = j.get("margin")
        ok = within({"agreement": j.get("agreement")}, {"agreement": band.get("agreement", 1.0)}) or (
            isinstance(margin, (int, float)) and margin <= band["near_tie"])
        return ok is (j.get("passed") is True)
    if within(figures, band) is not (j.get("passed") is True):
        return False
    if isinstance(j.get("local"), dict) and isinstance(j.get("local_band"), dict):
        return within(j["local"], j["local_band"]) is (j.get("local_passed") is True)
    return True


_VERDICT_LINE = re.compile(r"^\*\*Verdict: ([A-Z ]+)\*\*", re.M)
_CELL = re.compile(r"(?<!\\)\|")


def _check_summary(text: str, v: Verdict, per_cp: dict) -> list[str]:
    """summary.md: one line `**Verdict: STATUS**` equal to the rows' verdict; a heading that says DIVERGED
    exactly where the verdict is FAIL (at the first divergence's checkpoint and layer) and INCOMPLETE exactly
    where it is INCOMPLETE; each checkpoint's table
    cell (pass, **FAIL**, NOT COVERED) as its rows give."""
    out = []
    found = _VERDICT_LINE.findall(text)
    if len(found) != 1 or found[0] != v.status:
        out.append(f"its verdict line says {found or 'nothing'}, the rows give {v.status}")
    head = text.split("\n", 1)[0]
    fd = v.first_divergence
    if ("DIVERGED" in head) != (fd is not None) or (fd is not None and f"checkpoint {fd['checkpoint']}, layer "
                                                    f"{fd['layer']}," not in head):
        out.append("its heading " + (f"does not name the first divergence (checkpoint {fd['checkpoint']}, layer "
                                     f"{fd['layer']})" if fd is not None else "says DIVERGED where no row diverges"))
    if ("INCOMPLETE" in head) != (v.status == "INCOMPLETE"):
        out.append(f"its heading {'says' if 'INCOMPLETE' in head else 'does not say'} INCOMPLETE, the rows give "
                   f"{v.status}")
    want = {"PASS": "pass", "FAIL": "**FAIL**", "NOT COVERED": "NOT COVERED"}
    for line in text.splitlines():
        cells = [c.strip() for c in _CELL.split(line)[1:-1]] if line.startswith("| ") else []
        if len(cells) > 2 and cells[0] in per_cp and not cells[-1].startswith(want[per_cp[cells[0]]]):
            out.append(f"its row of checkpoint {cells[0]} says {cells[-1]!r}, the rows give {per_cp[cells[0]]}")
    return out


def _check_junit(text: str, res: DiffResult, v: Verdict) -> list[str]:
    """junit.xml: every testsuite's llorch.verdict property is the rows' verdict; the failing test cases are
    exactly the diverging rows and, unless the verdict is PASS, the verdict's own case; every failures count says
    so."""
    try:
        root = ET.fromstring(text)
    except ET.ParseError as e:
        return [f"not XML ({e})"]
    out = []
    props = [p.get("value") for s in root.iter("testsuite") for p in s.iter("property")
             if p.get("name") == "llorch.verdict"]
    suites = list(root.iter("testsuite"))
    if len(props) != len(suites) or any(p != v.status for p in props):
        out.append(f"its llorch.verdict properties say {sorted(set(props)) or 'nothing'}, the rows give {v.status}")
    want = {(f"llorch.cp{r.checkpoint}_{r.name}", _case_name(r.checkpoint, r.layer, r.tensor))
            for r in res.rows if r.diverges} | ({("llorch.verdict", "verdict")} if not v.passed else set())
    got = {(c.get("classname"), c.get("name")) for c in root.iter("testcase") if c.find("failure") is not None}
    if got != want:
        out.append(f"{len(got)} failing test cases, the rows give {len(want)} diverging"
                   + (f" (e.g. {sorted(want - got)[0][1]} not failed)" if want - got else ""))
    counts = [root.get("failures")] + [s.get("failures") for s in suites]
    if root.get("failures") != str(len(want)) or sum(int(s.get("failures") or 0) for s in suites) != len(want):
        out.append(f"its failures counts {counts[:1]} (suites {sum(int(c or 0) for c in counts[1:])}) are not the "
                   f"{len(want)} failing cases (diverging rows and the verdict)")
    return out


class _VerdictElement(HTMLParser):
    """Every element with id="verdict" of a page: its data-verdict attribute and its text."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.found, self._open, self._depth = [], None, 0

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if self._open is not None:
            self._depth += tag == self._open["tag"]
        elif a.get("id") == "verdict":
            self._open, self._depth = {"tag": tag, "status": a.get("data-verdict"), "text": ""}, 0

    def handle_endtag(self, tag):
        if self._open is None or tag != self._open["tag"]:
            return
        if self._depth:
            self._depth -= 1
        else:
            self.found.append(self._open)
            self._open = None

    def handle_data(self, data):
        if self._open is not None:
            self._open["text"] += data


def _check_html(text: str, v: Verdict) -> list[str]:
    """report.html: one element id="verdict", its data-verdict the rows' verdict and its text opening with
    DIVERGED (FAIL), INCOMPLETE or PASS accordingly."""
    p = _VerdictElement()
    p.feed(text)
    p.close()
    if len(p.found) != 1:
        return [f"{len(p.found)} elements with id=\"verdict\" (one is written)"]
    el, opens = p.found[0], {FAIL: "DIVERGED", INCOMPLETE: "INCOMPLETE", PASS: "PASS"}[v.status]
    if el["status"] != v.status or not el["text"].strip().startswith(opens):
        return [f"its verdict says {el['status']} ({el['text'].strip()[:60]!r}), the rows give {v.status}"]
    return []


def _check_checkpoint(rep: dict | None, md: str | None, verdict: str, fd) -> list[str]:
    """A checkpoint's report.json (passed, first_divergence) and report.md (its **Verdict: ...** line)."""
    out = []
    if rep is not None and (rep.get("passed") is not (verdict == "PASS") or rep.get("first_divergence") != fd):
        out.append(f"report.json says passed {rep.get('passed')}, first divergence {rep.get('first_divergence')}; "
                   f"the rows give {verdict}, {fd}")
    found = _VERDICT_LINE.findall(md or "")
    if md is not None and found != [verdict]:
        out.append(f"report.md says {found or 'no verdict'}, the rows give {verdict}")
    return out


def _check_repro(folder: Path, files: dict, man: dict, res: DiffResult, notes: list) -> list[str]:
    """repro/ is held exactly where the first divergence has a local figure (repro.write's rule) and the
    manifest does not say why there is none; its case.json names the first divergence and only plain names."""
    fd = res.first_divergence
    held = any(n.startswith("repro/") for n in files)
    entry = man.get("repro")
    if fd is None:
        return ["repro/ is held but no row diverges"] if held else []
    row = min((r for r in res.rows if r.diverges), key=lambda r: r.order)
    possible = row.local is not None and "nmse" in row.local
    if isinstance(entry, dict) and entry.get("written") is False:
        notes.append(f"repro: none in the bundle ({entry.get('why')})")
        return ["repro/ is held where the manifest says there is none"] if held else []
    if not possible:
        return (["repro/ is held for a divergence measured without a local figure"] if held else [])
    if "repro/case.json" not in files or TEST_REPRO not in files:
        return [f"case.json and test_repro.py are missing: the first divergence (checkpoint {fd['checkpoint']}, "
                f"layer {fd['layer']}, {fd['tensor']}) has a local figure and the manifest says the bundle holds its repro"]
    case = _read_json(folder, files, "repro/case.json")
    if not isinstance(case, dict):
        return ["repro/case.json is not a JSON object"]
    try:
        check_names(case, "repro/case.json")
    except HarnessError as e:
        return [str(e)]
    where = (case.get("checkpoint"), case.get("tensor"), case.get("layer"), case.get("step"))
    if where != (fd["checkpoint"], fd["tensor"].split("@")[0], fd["layer"], fd["step"]):
        return [f"repro/case.json is of checkpoint {where[0]}, {where[1]}, layer {where[2]}, step {where[3]}; the "
                f"first divergence is checkpoint {fd['checkpoint']}, {fd['tensor']}, layer {fd['layer']}"]
    return []


def pages_against(folder: Path, files: dict, man: dict, stored: dict, notes: list) -> tuple[Verdict, list[str]]:
    """-> (the rows' verdict, ["page: what"] for every page that contradicts it)."""
    res, v = rows_of(stored), verdict_of_rows(stored)
    specs = load_specs([str(c) for c in man.get("checkpoints") or []])
    per_cp = _checkpoint_verdicts(res, specs)
    out = [f"result.json: {c}" for c in _check_result_json(stored, res, v)]
    for name, check in (("summary.md", lambda t: _check_summary(t, v, per_cp)),
                        ("junit.xml", lambda t: _check_junit(t, res, v)), ("report.html", lambda t: _check_html(t, v))):
        text = _read_text(folder, files, name)
        out += [f"{name}: missing or not text"] if text is None else [f"{name}: {c}" for c in check(text)]
    for s in specs:
        d = checkpoint_folder(s)
        rep, md = _read_json(folder, files, f"{d}/report.json"), _read_text(folder, files, f"{d}/report.md")
        fd = v.first_divergence
        out += [f"{d}/{c}" for c in _check_checkpoint(rep if isinstance(rep, dict) else None, md, per_cp[s.id], fd)]
    out += [f"repro/: {c}" for c in _check_repro(folder, files, man, res, notes)]
    return v, out


def read_result(folder: Path, files: dict) -> dict | None:
    """result.json, checked against RESULT_SCHEMA (HarnessError: not JSON, nested too deep, not a comparison's
    rows); None where it is missing or not UTF-8."""
    text = _read_text(folder, files, "result.json")
    if text is None:
        return None
    stored = parse_json(text, folder / "result.json", HarnessError)
    check_schema(stored, RESULT_SCHEMA, folder / "result.json", HarnessError)
    return stored


# -- 5. the manifest against the tensors present ------------------------------------------------------------
def tensors_present(man: dict, files: dict) -> tuple[bool, list[str]]:
    """-> (every checkpoint keeps its subject's tensors, ["manifest.json: what"]): "tensors": false while tensor
    files are present, or tensors kept for some checkpoints and not others, contradict the manifest."""
    specs = load_specs([str(c) for c in man.get("checkpoints") or []])
    held = [n for n in files if n.endswith(("/subject.npz", "/reference.npz"))]
    subject = [s for s in specs if f"{checkpoint_folder(s)}/subject.npz" in files]
    out = []
    if man.get("tensors", True) is False and held:
        out.append(f'manifest.json: "tensors": false, but {len(held)} tensor files are present (e.g. {held[0]}): '
                   f"a manifest that would turn the re-run off")
    if subject and len(subject) != len(specs):
        out.append(f"manifest.json: tensors kept for {len(subject)} of {len(specs)} checkpoints (a bundle keeps "
                   f"all of them or none)")
    elif not subject and man.get("tensors", True) is not False:
        out.append('manifest.json: "tensors": true, but no checkpoint keeps its subject.npz')
    return bool(specs) and len(subject) == len(specs), out


# -- the whole check ----------------------------------------------------------------------------------------
def verify_bundle(folder, rerun: bool = True, model=None, log=None, key=None) -> Verification:
    """The walk, the hashes, the signature (under key, a PEM public key file), the code, the pages against the
    rows' verdict, the manifest against the files; with rerun (and the tensors present), the reference run
    again and the figures and verdict redone."""
    folder = Path(folder)
    files = scan_bundle(folder)
    man = read_manifest(folder, files)
    v = check_files(folder, man, files)
    v.signature = check_signature(folder, files, key)
    v.band_class = man.get("band_class")
    v.model = {"path": (man["recipe"] or {}).get("model"), "sha256": (man["recipe"] or {}).get("model_sha256"),
               "checked": False}
    v.subject_model = {"path": man.get("model"), "sha256": man.get("model_sha256")}
    v.refused = refused_code(folder, files)
    if man.get("format") != FORMAT:
        v.manifest_faults.append(f"manifest.json: format {man.get('format')}: its pages carry no verdict verify can "
                                f"read (a format older than {FORMAT}: prove it again)")
        stored = None
    else:
        stored = read_result(folder, files)
        if stored is None:
            v.contradictions.append("result.json: missing or not text: no verdict to check")
    if stored is not None:
        verdict, found = pages_against(folder, files, man, stored, v.notes)
        v.verdict = {**verdict.to_json(), "line": verdict.line(), "coverage": verdict.coverage_line(),
                     "from": "result.json's rows"}
        v.contradictions += found
    all_held, found = tensors_present(man, files)
    v.manifest_faults += found
    if rerun and stored is not None and (man["recipe"] or {}).get("kind") == "blackbox":
        v.rerun = rerun_blackbox(folder, files, man, stored, model=model, log=log)
        v.model.update(checked=True, read=v.rerun.pop("model_read"))
    elif rerun and not all_held:
        v.rerun = {"figures_hold": None, "why": "the bundle keeps no tensors (written with --no-tensors): its "
                                                "figures cannot be redone, only its files and pages checked"}
    elif rerun and stored is not None:
        v.rerun = rerun_and_compare(folder, man, stored, model=model, log=log)
        v.model.update(checked=True, read=v.rerun.pop("model_read"))
    return v


# -- 6. the re-run ------------------------------------------------------------------------------------------
def check_model_file(path: Path, named) -> os.stat_result:
    """The reference's model is a regular file or a folder (os.stat, links followed: the model lies outside
    the bundle); a device (/dev/zero), FIFO or socket is refused unread."""
    try:
        st = os.stat(path)
    except OSError:
        raise HarnessError(f"{path}: the reference's model file is not here (the manifest names {named}); "
                           f"pass --model PATH") from None
    if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
        raise HarnessError(f"{path}: not a regular file or folder (a device, FIFO or socket): the reference's model "
                           f"must be a model file (the manifest names {named}); pass --model PATH")
    return st


def model_file_sha256(path: Path) -> str:
    """The sha256 of a model: a regular file's first st_size bytes and never more (a file that grows while
    it is read gives another hash, not a hang); a folder by model_sha256's rule (its regular files only)."""
    st = os.stat(path)
    if stat.S_ISDIR(st.st_mode):
        return model_sha256(path)
    h, left = hashlib.sha256(), st.st_size
    with open(path, "rb") as f:
        while left > 0:
            block = f.read(min(left, 1 << 20))
            if not block:
                break
            h.update(block)
            left -= len(block)
    return h.hexdigest()


def _model_config(recipe: dict, path: Path):
    """The reference model's Config without running it: a GGUF file's metadata, else the loaded folder's."""
    import llorch_ref

    try:
        return gguf_config(path) if path.is_file() else llorch_ref.load(path).config
    except (ValueError, KeyError, OSError) as e:
        raise HarnessError(f"{path}: not a model llorch-ref reads ({type(e).__name__}: {str(e)[:120]})") from None


def rerun_keys(stored: dict) -> set:
    """The (checkpoint, tensor) pairs the re-run records: those the bundle's rows compared, the tokenization
    and the greedy tokens (run.held_keys' rule for a dump)."""
    keys = {(str(r["checkpoint"]), r["tensor"].split("@")[0].split("(")[0]) for r in stored["rows"]}
    return keys | {("0", "token_ids"), ("12", "greedy_tokens")}


def check_rerun(recipe: dict, cfg, stored: dict, model_bytes: int) -> int:
    """Refuse a re-run that cannot fit, ahead of running it: the prompt and decode tokens inside the model's
    context and every id inside its vocabulary; the memory the re-run needs (run.comparison_bytes of what the
    rows compared, plus the model file) inside RERUN_SHARE of MemAvailable. -> the estimate in bytes."""
    ids, decode = recipe["token_ids"], recipe.get("decode_ids") or []
    fed = len(ids) + len(decode)
    if fed > cfg.context_length:
        raise HarnessError(f"the recipe's {len(ids)} prompt and {len(decode)} decode tokens exceed the model's context "
                           f"of {cfg.context_length}: not a run llorch-ref could have made")
    bad = [t for t in list(ids) + list(decode) if t >= cfg.n_vocab]
    if bad:
        raise HarnessError(f"the recipe's token id {bad[0]} is outside the model's vocabulary (0..{cfg.n_vocab - 1})")
    shape = types.SimpleNamespace(token_ids=ids, rows=recipe.get("rows") or ids, decode_token_ids=decode)
    keys = rerun_keys(stored)
    need, have = comparison_bytes(shape, cfg, keys) + model_bytes, int(RERUN_SHARE * mem_available())
    if need > have:
        raise HarnessError(f"re-running this bundle's reference needs about {need / 2**30:.1f} GiB ({len(ids)} tokens, "
                           f"{len(decode)} decode steps, {len(keys)} tensor kinds, the model's {model_bytes / 2**30:.1f} "
                           f"GiB), over the {have / 2**30:.1f} GiB (80% of the memory available) it may take: verify "
                           f"--no-rerun checks its files and pages")
    return need


def tensor_limit(recipe: dict, cfg):
    """-> limit(member name) -> the most elements a bundle's tensor of that name can hold: its catalogue shape
    over the recipe's tokens (T: the prompt's tokens, S: prompt and decode tokens, N: those and the greedy
    ones); a name that is no checkpoint tensor (cp<id>.<tensor>[.layer<L>][.step<K>]) is refused."""
    t, steps = len(recipe["token_ids"]), len(recipe.get("decode_ids") or [])
    dims = {**dims_of(cfg, t, past=steps), "N": t + steps + int(recipe["n_greedy"]) + 1}
    cat = catalogue()
    sizes = {k: int(np.prod(expected_shape(e, dims) or [dims["N"]], dtype=np.int64)) for k, e in cat.items()}

    def limit(name: str) -> int | None:
        base, step = split_step(name)
        m = NAME_RE.match(base)
        if not m or step > steps or (m["layer"] is not None and int(m["layer"]) >= cfg.n_layers):
            return None
        return sizes.get((m["cp"], m["tensor"]), max(sizes.values()))
    return limit


def _member_header(z: zipfile.ZipFile, info: zipfile.ZipInfo):
    """-> (shape, dtype) from an .npy member's header, read without its data."""
    with z.open(info) as f:
        version = np.lib.format.read_magic(f)
        read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, _, dtype = read(f)
    return shape, dtype


def _check_member(z: zipfile.ZipFile, info: zipfile.ZipInfo, limit, where) -> str:
    """A member is a numeric .npy array of a checkpoint tensor's name whose declared uncompressed size
    (ZipInfo.file_size) and header shape x dtype lie inside limit(name) (tensor_limit), checked ahead of
    reading its data. -> its name."""
    name = info.filename[:-4] if info.filename.endswith(".npy") else None
    most = limit(name) if name else None
    if most is None:
        raise HarnessError(f"{where}: member {info.filename[:80]!r} is not a checkpoint tensor of this model "
                           f"(cp<id>.<tensor>[.layer<L>]): not as llorch-ref writes it")
    if info.file_size > most * 8 + NPY_HEADER:
        raise HarnessError(f"{where}: {name} declares {info.file_size / 2**30:.2f} GiB uncompressed; this bundle's "
                           f"shapes allow at most {(most * 8 + NPY_HEADER) / 2**20:.1f} MiB: refused unread")
    shape, dtype = _member_header(z, info)
    if dtype.hasobject or dtype.kind not in "biuf":
        raise HarnessError(f"{where}: {name} is an array of {'objects' if dtype.hasobject else dtype}: a bundle's "
                           f"tensors are numbers (object arrays would run pickled code): refused")
    n = int(np.prod(shape, dtype=np.int64))
    if n > most or n * dtype.itemsize > info.file_size:
        raise HarnessError(f"{where}: {name} declares shape {list(shape)[:6]} ({n} elements); this bundle's shapes "
                           f"allow at most {most} and its member holds {info.file_size} bytes: refused unread")
    return name


def read_npz(p: Path, limit, where) -> NpzTensors:
    """{name: array} of a bundle's tensor file (tensor_file.NpzTensors: read on lookup), every member checked
    (_check_member, and its bytes inflated once: a damaged one is refused here) ahead of reading it and read
    without pickles (np.load's allow_pickle=False rule); HarnessError (one line) for a file that is not
    a zip, a member that breaks the bound, a truncated or corrupt member."""
    try:
        with zipfile.ZipFile(p) as z:
            infos = z.infolist()
            names = [_check_member(z, i, limit, where) for i in infos]
            for info in infos:                     # every byte inflated and its CRC checked, none kept
                with z.open(info) as f:
                    while f.read(16 * 2**20):
                        pass
        # each tensor read when asked for (a long run's bundle: one in memory at a time)
        return NpzTensors({name: (p, info.filename) for name, info in zip(names, infos)}, HarnessError)
    except zipfile.BadZipFile as e:
        raise HarnessError(f"{where}: not an .npz (zip) file ({e})") from None
    except (ValueError, OSError, EOFError, zlib.error, RuntimeError, NotImplementedError) as e:
        raise HarnessError(f"{where}: a damaged or truncated tensor file ({type(e).__name__}: {str(e)[:120]})") from None


def _subject(folder: Path, man, limit) -> Dump:
    """The subject's tensors the bundle keeps (every checkpoint's subject.npz, read_npz under limit), as a
    canonical dump."""
    parts = []
    for cp in man["checkpoints"]:
        spec = load_specs([cp])[0]
        rel = f"cp{spec.id}_{spec.name}/subject.npz"
        p = folder / rel
        if not p.is_file():
            raise HarnessError(f"{p}: missing: the figures cannot be redone without the subject's tensors "
                               f"(verify --no-rerun checks the hashes alone)")
        parts.append(read_npz(p, limit, rel))
    tensors = NpzTensors.joined(parts, HarnessError)            # read when compared, one at a time
    side = {**man["sides"]["subject"], "layouts": dict(CANONICAL_LAYOUTS)}
    validate_manifest(side, f"{MANIFEST} sides/subject")      # the dump format's own schema (DumpError)
    return Dump(manifest=side, tensors=tensors, source=f"{folder} (subject)")


def _reference(recipe, path: Path, log):
    """-> (Dump of the reference side run again, the llorch-ref engine when it is the reference, else None,
    the model's Config)."""
    import llorch_ref

    kind, ids = recipe["kind"], recipe["token_ids"]
    if log:
        log(f"llorch-ref: running the reference side again ({kind} on {path.name}, {len(ids)} tokens) ...")
    if kind == "llamacpp":
        d = dump_llamacpp(path, prompt=recipe.get("prompt"), token_ids=ids, n_greedy=recipe["n_greedy"],
                          kv_dtype=recipe["kv_dtype"], checkpoints=recipe.get("checkpoints"),
                          n_ubatch=recipe.get("n_ubatch", 512), n_batch=recipe.get("n_batch"), rows=recipe.get("rows"),
                          n_gpu_layers=recipe.get("n_gpu_layers", 0))
        return d.to_dump(), None, gguf_config(path)
    if kind == "llorch":
        eng = llorch_ref.load(path, backend=recipe["backend"], numerics=recipe["numerics"], kv_dtype=recipe["kv_dtype"],
                              ggml_simd=recipe.get("ggml_simd") or "auto")
        d = record_engine(eng, ids, prompt=recipe.get("prompt"), n_greedy=recipe["n_greedy"],
                          decode_ids=recipe.get("decode_ids"), rows=recipe.get("rows"))
        return d.to_dump(), eng, eng.config
    if kind == "transformers":
        d = dump_transformers(path, prompt=recipe.get("prompt"), token_ids=ids, n_greedy=recipe["n_greedy"])
        return d.to_dump(), None, llorch_ref.load(path).config
    raise HarnessError(f"recipe kind {kind!r} is not one of llamacpp, llorch, transformers")


def rerun_and_compare(folder: Path, man, stored: dict, model=None, log=None) -> dict:
    """The reference run again from the recipe, the comparison redone: each row's verdict, the figures, the
    re-run's verdict against the rows' verdict, the reference's tensors against the bundle's."""
    recipe = man["recipe"]
    if not recipe:
        raise HarnessError(f"{folder}: the manifest keeps no recipe for the reference side (its run wrote none): "
                           f"verify --no-rerun checks the hashes")
    path = Path(model) if model else expand_path(recipe["model"])
    st = check_model_file(path, recipe["model"])
    sha = model_file_sha256(path)
    if sha != recipe["model_sha256"]:
        raise HarnessError(f"{path}: sha256 {sha[:16]}… is not the {recipe['model_sha256'][:16]}… the run used: "
                           f"another file")
    cfg = _model_config(recipe, path)
    check_rerun(recipe, cfg, stored, st.st_size if stat.S_ISREG(st.st_mode) else 0)
    limit = tensor_limit(recipe, cfg)
    sub = _subject(folder, man, limit)
    ref, eng, cfg = _reference(recipe, path, log)
    bands = backend_bands(recipe["backend_band"]) if recipe.get("backend_band") else None
    res = compare_dumps(sub, ref, cfg, man["band_class"], checkpoints=recipe.get("checkpoints"), bands=bands,
                        subject_label=man["subject"], reference_label=man["reference"],
                        local_engine=eng if recipe.get("local") else None)
    res.require = man.get("require") or recipe.get("require") or "auto"
    out = {**_figures_against(stored, res), **_tensors_against(folder, man, res, limit), "model_read": str(path)}
    now, rows = res.verdict(), verdict_of_rows(stored)
    same = now.status == rows.status and now.first_divergence == rows.first_divergence
    out.update(verdict={**now.to_json(), "line": now.line(), "coverage": now.coverage_line()}, verdict_holds=same,
               rows_status=rows.status, figures_hold=out["figures_hold"] and same and not out["reference_faults"])
    return out


BLACKBOX_FIGURES = ("kld", "ref_logprob", "engine_logprob", "rank", "margin")


def figure_holds(name: str, bundle, now, row: dict) -> bool:
    """A black-box figure of the bundle against the re-run's: within 1e-6 + 1e-4 of its size, where a margin's or a
    KLD's size is that of the log-probabilities it is made of (at least 1): the reference's float32 sums move by about
    1e-5 between BLAS thread counts and kernels (OpenBLAS's Haswell kernels split a prompt's rows among threads by
    the row count), and a difference of two log-probabilities keeps that absolute error, not its own relative one."""
    size = max(abs(bundle), abs(now))
    if name in ("margin", "kld"):
        size = max([size, 1.0] + [abs(row[k]) for k in ("ref_logprob", "engine_logprob")
                                  if isinstance(row.get(k), (int, float))])
    return abs(bundle - now) <= 1e-6 + 1e-4 * size


def rerun_blackbox(folder: Path, files: dict, man, stored: dict, model=None, log=None) -> dict:
    """A black-box bundle (recipe kind "blackbox"): the reference run teacher-forced again on the engine's trace
    the bundle keeps (trace.json, trace.npz), every step compared again: each row's verdict, and each step's
    figures (BLACKBOX_FIGURES) as figure_holds has them against the stored ones."""
    import llorch_ref

    recipe = man["recipe"]
    path = Path(model) if model else expand_path(recipe["model"])
    check_model_file(path, recipe["model"])
    sha = model_file_sha256(path)
    if sha != recipe["model_sha256"]:
        raise HarnessError(f"{path}: sha256 {sha[:16]}… is not the {recipe['model_sha256'][:16]}… the run used: "
                           f"another file")
    cfg = _model_config(recipe, path)
    ids = recipe["token_ids"]
    if len(ids) > cfg.context_length or any(t >= cfg.n_vocab for t in ids):
        raise HarnessError(f"the recipe's {len(ids)} tokens do not fit the model (context {cfg.context_length}, "
                           f"vocabulary {cfg.n_vocab}): not a run llorch-ref could have made")
    n_steps = len([r for r in stored["rows"] if str(r["checkpoint"]) == "11" and r["tensor"] != RUN])
    text = _read_text(folder, files, TRACE_JSON)
    if text is None or "trace.npz" not in files:
        raise HarnessError(f"{folder}: no {TRACE_JSON} and trace.npz: the engine's side cannot be compared again "
                           f"(verify --no-rerun checks the hashes)")
    trace = read_trace(folder, n_steps, cfg.n_vocab, text)
    eng = llorch_ref.load(path, backend=recipe["backend"], numerics=recipe["numerics"], kv_dtype=recipe["kv_dtype"],
                          ggml_simd=recipe.get("ggml_simd") or "auto")
    res = compare_trace(eng, trace, require=man.get("require") or "auto")
    out = _figures_against(stored, res)
    now = {_key(r): r for r in res.to_json()["rows"]}
    for r in stored["rows"]:
        n = now.get(_key(r)) or {}
        for f in BLACKBOX_FIGURES:
            a, b = r.get(f), n.get(f)
            if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not figure_holds(f, a, b, r):
                out["verdicts_changed"].append(f"cp{r['checkpoint']} {r['tensor']}: {f} {a:.6g} in the bundle, "
                                               f"{b:.6g} re-run")
    now_v, rows = res.verdict(), verdict_of_rows(stored)
    same = now_v.status == rows.status and now_v.first_divergence == rows.first_divergence
    out.update(verdict={**now_v.to_json(), "line": now_v.line(), "coverage": now_v.coverage_line()},
               verdict_holds=same, rows_status=rows.status, reference_faults=[], reference_tensors=0,
               reference_bit_equal=0, reference_worst={"tensor": None, "nmse": 0.0}, model_read=str(path),
               figures_hold=not out["verdicts_changed"] and out["figures_hold"] and same)
    return out


def _key(r: dict) -> tuple:
    t = r["tensor"].split("(")[0]                   # argmax(cp8.logits) and argmax name one comparison
    return r["checkpoint"], r["layer"], t, r.get("step", 0)


def _diverges(r: dict) -> bool:
    """Row.diverges of a row as JSON (its flags: local_passed, local_covers, passed)."""
    return _row(r).diverges


def _figures_against(stored: dict, res) -> dict:
    """Each stored comparison against the redone one: the verdicts, the first divergence, the largest change."""
    now = {_key(r): r for r in res.to_json()["rows"]}
    changed, worst = [], {"figure": None, "relative_change": 0.0}
    for r in stored["rows"]:
        n = now.get(_key(r))
        if n is None:
            changed.append(f"cp{r['checkpoint']} {r['tensor']} L{r['layer']}: not compared again")
            continue
        if _diverges(n) != _diverges(r):
            changed.append(f"cp{r['checkpoint']} {r['tensor']} L{r['layer']}: "
                           f"{'diverges' if _diverges(r) else 'passes'} in the bundle, "
                           f"{'diverges' if _diverges(n) else 'passes'} now")
        for fig, a, b in (("nmse", r.get("nmse"), n.get("nmse")),
                          ("local nmse", (r.get("local") or {}).get("nmse"), (n.get("local") or {}).get("nmse"))):
            if isinstance(a, float) and isinstance(b, float) and np.isfinite(a) and np.isfinite(b):
                rel = abs(a - b) / max(abs(a), abs(b), 1e-30)
                if rel > worst["relative_change"]:
                    worst = {"figure": f"{fig} of cp{r['checkpoint']} {r['tensor']} L{r['layer']}", "bundle": a,
                             "now": b, "relative_change": rel}
    fd = rows_of(stored).first_divergence
    return {"figures_hold": not changed and fd == res.first_divergence, "comparisons": len(stored["rows"]),
            "verdicts_changed": changed, "first_divergence": {"bundle": fd, "now": res.first_divergence},
            "largest_change": worst}


def _tensors_against(folder: Path, man, res, limit) -> dict:
    """The re-run reference's tensors against those the bundle keeps (read_npz under limit): how many are
    bit-equal, the worst NMSE."""
    equal = total = 0
    worst, faults = {"tensor": None, "nmse": 0.0}, []
    for cp in man["checkpoints"]:
        spec = load_specs([cp])[0]
        rel = f"cp{spec.id}_{spec.name}/reference.npz"
        if not (folder / rel).is_file():
            continue
        kept = read_npz(folder / rel, limit, rel)
        now = {k for k in res.captures_ref if k.startswith(f"cp{spec.id}.")}
        if set(kept) != now:
            faults.append(f"{rel} holds {len(kept)} tensors, the re-run records {len(now)} (e.g. "
                          f"{sorted(set(kept) ^ now)[0]})")
        for k in kept:                            # one kept tensor read at a time
            a = kept[k]
            b = res.captures_ref.get(k)
            if b is None:
                continue
            total += 1
            if a.shape == np.shape(b) and np.array_equal(a, b):
                equal += 1
                continue
            m = compare(np.asarray(b, np.float64), a.astype(np.float64)) if a.shape == np.shape(b) else None
            if m is None or not m["nmse"] <= REFERENCE_NMSE or a.dtype.kind != np.asarray(b).dtype.kind:
                faults.append(f"{rel}: {k} is not the re-run reference's" + (
                    f" (shape {list(a.shape)}, the re-run's {list(np.shape(b))})" if m is None else
                    f" (NMSE {m['nmse']:.3g}, over {REFERENCE_NMSE:g}; {a.dtype} against {np.asarray(b).dtype})"))
            elif m["nmse"] > worst["nmse"]:
                worst = {"tensor": k, "nmse": m["nmse"], "max_abs": m["max_abs"]}
    return {"reference_faults": faults, "reference_tensors": total, "reference_bit_equal": equal, "reference_worst": worst}
