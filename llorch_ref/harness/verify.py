"""Verify a proof bundle: every file against the sha256 its manifest holds (an edited, missing or added file is
named), then the reference side run again from the manifest alone (its recipe: model file and sha256, token
ids, settings) and the comparison redone on the subject's tensors the bundle keeps: the figures hold when every
comparison keeps its verdict and the first divergence is the same one. The re-run reference's tensors are
compared with the ones the bundle keeps (bit-equal on the machine and build that wrote it; a few ulps apart
elsewhere), and the largest change of any figure is printed.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..checkpoints import load_specs
from ..dump import CANONICAL_LAYOUTS, Dump, model_sha256
from ..errors import HarnessError
from ..references.engines import dump_llamacpp, dump_transformers, gguf_config
from ..references.llorch import record_engine
from .bundle import MANIFEST, file_hashes
from .compare import compare_dumps
from .metrics import compare
from .portable import expand_path
from .run import backend_bands


@dataclass
class Verification:
    folder: str
    n_files: int = 0
    edited: list = field(default_factory=list)      # files whose sha256 changed
    missing: list = field(default_factory=list)     # files the manifest lists that are gone
    added: list = field(default_factory=list)       # files the manifest does not list
    rerun: dict | None = None                       # the re-run's findings (None: not re-run)

    @property
    def files_ok(self) -> bool:
        return not (self.edited or self.missing or self.added)

    @property
    def ok(self) -> bool:
        return self.files_ok and (self.rerun is None or self.rerun["figures_hold"] is not False)

    def to_json(self) -> dict:
        return {"folder": self.folder, "ok": self.ok, "files_ok": self.files_ok, "edited": self.edited,
                "missing": self.missing, "added": self.added, "rerun": self.rerun}


def read_manifest(folder) -> dict:
    folder = Path(folder)
    p = folder / MANIFEST
    if not folder.is_dir():
        raise HarnessError(f"{folder}: no such bundle folder (a run's folder: <out>/<run_id>/)")
    if not p.is_file():
        raise HarnessError(f"{folder}: no {MANIFEST}: not a proof bundle (or one written before format "
                           f"llorch-proof/2, which kept no hashes)")
    try:
        man = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise HarnessError(f"{p}: not JSON ({e}): the manifest itself was damaged") from None
    if not isinstance(man, dict) or not isinstance(man.get("files"), dict) or "recipe" not in man:
        raise HarnessError(f"{p}: no 'files' and 'recipe': not a llorch-proof/2 manifest")
    return man


def check_files(folder, man) -> Verification:
    folder = Path(folder)
    now = file_hashes(folder)
    v = Verification(folder=str(folder), n_files=len(man["files"]))
    for name, sha in sorted(man["files"].items()):
        if name not in now:
            v.missing.append(name)
        elif now[name] != sha:
            v.edited.append(name)
    v.added = sorted(set(now) - set(man["files"]))
    return v


def verify_bundle(folder, rerun: bool = True, model=None, log=None) -> Verification:
    """The files against their hashes; with rerun, the reference run again and the figures redone."""
    man = read_manifest(folder)
    v = check_files(folder, man)
    if rerun and not man.get("tensors", True):
        v.rerun = {"figures_hold": None, "why": "the bundle keeps no tensors (written with --no-tensors): its "
                                                "figures cannot be redone, only its files checked"}
    elif rerun:
        v.rerun = rerun_and_compare(Path(folder), man, model=model, log=log)
    return v


def _subject(folder: Path, man) -> Dump:
    """The subject's tensors the bundle keeps (every checkpoint's subject.npz), as a canonical dump."""
    tensors = {}
    for cp in man["checkpoints"]:
        spec = load_specs([cp])[0]
        p = folder / f"cp{spec.id}_{spec.name}" / "subject.npz"
        if not p.is_file():
            raise HarnessError(f"{p}: missing: the figures cannot be redone without the subject's tensors "
                               f"(verify --no-rerun checks the hashes alone)")
        with np.load(p) as z:
            tensors.update({k: z[k] for k in z.files})
    side = {**man["sides"]["subject"], "layouts": dict(CANONICAL_LAYOUTS)}
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
                          n_ubatch=recipe.get("n_ubatch", 512), rows=recipe.get("rows"))
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


def rerun_and_compare(folder: Path, man, model=None, log=None) -> dict:
    recipe = man["recipe"]
    if not recipe:
        raise HarnessError(f"{folder}: the manifest keeps no recipe for the reference side (its run wrote none): "
                           f"verify --no-rerun checks the hashes")
    path = Path(model) if model else expand_path(recipe["model"])
    if not path.exists():
        raise HarnessError(f"{path}: the reference's model file is not here (the manifest names {recipe['model']}); "
                           f"pass --model PATH")
    sha = model_sha256(path)
    if sha != recipe["model_sha256"]:
        raise HarnessError(f"{path}: sha256 {sha[:16]}… is not the {recipe['model_sha256'][:16]}… the run used: "
                           f"another file")
    sub = _subject(folder, man)
    ref, eng, cfg = _reference(recipe, path, log)
    bands = backend_bands(recipe["backend_band"]) if recipe.get("backend_band") else None
    res = compare_dumps(sub, ref, cfg, man["band_class"], checkpoints=recipe.get("checkpoints"), bands=bands,
                        subject_label=man["subject"], reference_label=man["reference"],
                        local_engine=eng if recipe.get("local") else None)
    stored = json.loads((folder / "result.json").read_text())
    return {**_figures_against(stored, res), **_tensors_against(folder, man, res)}


def _key(r: dict) -> tuple:
    t = r["tensor"].split("(")[0]                   # argmax(cp8.logits) and argmax name one comparison
    return r["checkpoint"], r["layer"], t, r.get("step", 0)


def _diverges(r: dict) -> bool:
    return not (r["local_passed"] if r.get("local_passed") is not None else r["passed"])


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
    same_fd = stored.get("first_divergence") == res.first_divergence
    return {"figures_hold": not changed and same_fd, "comparisons": len(stored["rows"]), "verdicts_changed": changed,
            "first_divergence": {"bundle": stored.get("first_divergence"), "now": res.first_divergence},
            "largest_change": worst}


def _tensors_against(folder: Path, man, res) -> dict:
    """The re-run reference's tensors against those the bundle keeps: how many are bit-equal, the worst NMSE."""
    equal = total = 0
    worst = {"tensor": None, "nmse": 0.0}
    for cp in man["checkpoints"]:
        spec = load_specs([cp])[0]
        p = folder / f"cp{spec.id}_{spec.name}" / "reference.npz"
        if not p.is_file():
            continue
        with np.load(p) as z:
            for k in z.files:
                b = res.captures_ref.get(k)
                if b is None:
                    continue
                a = z[k]
                total += 1
                if a.shape == np.shape(b) and np.array_equal(a, b):
                    equal += 1
                elif a.dtype.kind == "f" and a.shape == np.shape(b):
                    m = compare(np.asarray(b), a)
                    if m["nmse"] > worst["nmse"]:
                        worst = {"tensor": k, "nmse": m["nmse"], "max_abs": m["max_abs"]}
    return {"reference_tensors": total, "reference_bit_equal": equal, "reference_worst": worst}
