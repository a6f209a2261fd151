"""A minimal repro of a comparison's first divergence: the one operation, its inputs as the subject produced
them, the weights it reads, the reference output and the subject's output, and a standalone pytest file.

    repro/
      case.json                  the operation (checkpoint, tensor, layer, step), positions, model settings,
                                 the arithmetic, the band and the figures the bundle measured
      inputs/<name>.npy          the subject's tensors the operation reads (canonical layout)
      weights/<name>.npy         the weights it reads: float arrays, or GGUF blocks (numerics ggml)
      reference_output.npy       the reference's operation on those inputs (the local reference)
      subject_output.npy         the subject's output
      test_repro.py              `pytest repro/`: needs numpy and llorch-ref, not the subject engine

The inputs, weights and outputs are recorded while the reference's operation runs (local.local_outputs with
one output asked for), so the repro holds exactly what the operation read.

Running a received repro executes code: test_repro.py is written from case.json by repro_test_source alone
(its values kept inside the docstring), so `verify` writes it again and refuses one that differs by a byte;
load refuses a case.json whose input, weight or mask names leave the folder.
"""
from __future__ import annotations

import json
import re
import types
from pathlib import Path

import numpy as np

from ..backends import get_backend
from ..config import Config
from ..dump import catalogue, to_canonical
from ..errors import HarnessError
from ..loaders.gguf_file import open_reader, qtensors_of
from ..model import layers as layer_ops
from ..model.cache import Cache
from ..model.qtensor import QTensor
from ..numerics.ggml_cpu import SIMD_LANES, FloatMatrix, make_ops, matrix_of
from .compare import dims_of, fused_attention, neox_rows, subject_getter
from .local import last_row, local_outputs, model_outputs, visible
from .metrics import compare, fmt, fmt_cos, within

TEST_FILE = '''"""The first divergence of proof run {run_id}: {what}.

The subject's output of this one operation, against llorch-ref's operation on the subject's own inputs, is
outside its band. Needs numpy and llorch-ref only (not the subject engine):

    pytest {folder}/
"""
from pathlib import Path

from llorch_ref.harness.repro import check_reference, check_subject, load

HERE = Path(__file__).parent


def test_reference_operation_gives_the_stored_output():
    check_reference(load(HERE))


def test_subject_output_inside_the_band():
    check_subject(load(HERE))
'''


_DOCSTRING_UNSAFE = re.compile(r'[^\x20-\x7e]|[\\"]')      # printable ASCII but the backslash and the quote


def _docstring_text(s) -> str:
    """s as text that cannot end or escape a docstring: every character but printable ASCII, every backslash
    and every double quote replaced by '?' (a case's run id and description are data, never code)."""
    return _DOCSTRING_UNSAFE.sub("?", str(s))


def repro_test_source(case: dict) -> str:
    """test_repro.py of a case, exactly: the one code file a bundle holds. `verify` writes it again from the
    bundle's case.json and refuses a test_repro.py that differs by a byte."""
    return TEST_FILE.format(run_id=_docstring_text(case.get("run_id") or ""), what=_docstring_text(case.get("what")),
                            folder="repro")


class _Recorded:
    """A read-through view of a weights object that remembers every attribute read."""

    def __init__(self, inner, into: dict):
        self._inner, self._into = inner, into

    def __getattr__(self, name):
        v = getattr(self._inner, name)
        self._into[name] = v
        return v


def write(folder: Path, result, engine, man) -> dict | None:
    """The repro of result's first divergence, where it is a tensor whose local error decides; -> {"what",
    "written": bool, "why"?} or None when nothing diverges. Nothing is written where no repro can be made (the
    reason is returned)."""
    fd = result.first_divergence
    if fd is None:
        return None
    row = min((r for r in result.rows if r.diverges), key=lambda r: r.order)
    what = (f"checkpoint {row.checkpoint}, {row.tensor.split('@')[0]}"
            + ("" if row.layer is None else f", layer {row.layer}") + (f", decode step {row.step}" if row.step else ""))
    if row.local is None or "nmse" not in row.local:
        return {"what": what, "written": False,
                "why": "the divergence is measured end to end only (no local figure: the comparison had no "
                       "subject inputs to run the reference's operation on)" if row.local is None else
                       "a token checkpoint (its local check is the argmax of the subject's own logits)"}
    try:
        case, arrays = _record(result, engine, row)
    except HarnessError as e:
        return {"what": what, "written": False, "why": str(e)}
    case.update(what=what, run_id=man.get("run_id"), subject=result.subject_label, reference=result.reference_label,
                model=man["model"], model_sha256=man["model_sha256"], band=row.local_band, figures=row.local)
    folder.mkdir()
    for sub in ("inputs", "weights"):
        (folder / sub).mkdir()
    for rel, a in arrays.items():
        np.save(folder / rel, a)
    (folder / "case.json").write_text(json.dumps(case, indent=2) + "\n")
    (folder / "test_repro.py").write_text(repro_test_source(case))
    return {"what": what, "written": True, "inputs": case["inputs"], "weights": sorted(case["weights"]),
            "subject_output": arrays["subject_output.npy"], "reference_output": arrays["reference_output.npy"]}


def _record(result, engine, row):
    """Run the reference's operation for row on the subject's inputs, recording what it reads."""
    tensor = row.tensor.split("@")[0]
    sub = result.subject_dump()
    if row.step:
        sub = sub.step_view(row.step)
    cfg = engine.config
    dims = dims_of(cfg, len(sub.token_ids), past=len(sub.past_token_ids), n_rows=len(sub.rows))
    positions = np.asarray(sub.rows) + len(sub.past_token_ids)
    read, weights = {}, {}
    base = subject_getter(engine, sub, dims)

    def get(name, layer):
        a = base(name, layer)
        if a is not None:
            read[f"{name}.layer{layer}" if layer is not None else name] = a
        return a

    w = engine.weights
    view = (_Recorded(w, weights) if row.layer is None else        # the head reads out_norm / output
            types.SimpleNamespace(layers={row.layer: _Recorded(w.layers[row.layer], weights)}, tok_embd=w.tok_embd))
    ids = [sub.token_ids[r] for r in sub.rows]
    proxy = types.SimpleNamespace(config=cfg, ops=engine.ops, xp=engine.xp, backend=engine.backend,
                                  numerics=engine.numerics, new_cache=engine.new_cache, weights=view,
                                  qk_rows=getattr(engine, "qk_rows", "adjacent"))
    out = _operation(proxy, get, row.layer, tensor, ids, fused_attention(sub), len(sub.past_token_ids), positions,
                     row.checkpoint)
    if out is None:
        raise HarnessError(f"the reference's operation for {tensor} did not run on the subject's inputs")
    arrays = {f"inputs/{k}.npy": v for k, v in read.items()}
    if row.layer == 0 and tensor in ("attn_norm", "ffn_inp"):
        weights["tok_embd"] = engine.backend.to_numpy(w.tok_embd[np.asarray(ids)])      # the rows looked up
    case_weights = {}
    for name, v in weights.items():
        case_weights[name], files = _weight_files(engine, row.layer, name, v)
        arrays.update(files)
    entry = catalogue()[(row.checkpoint, tensor)]
    s = sub.get(row.checkpoint, tensor, row.layer, dims)
    lo = _finish(out, entry, dims, row.checkpoint, neox_rows(engine, row.checkpoint, tensor))
    if tensor == "kq":
        vis = visible(cfg, row.layer, positions, s.shape[-1])
        arrays["visible.npy"] = vis
        s, lo = (np.where(vis[None], a, np.float32(0)).astype(np.float32) for a in (s, lo))
    arrays.update({"subject_output.npy": s, "reference_output.npy": lo})
    case = {"checkpoint": row.checkpoint, "tensor": tensor, "layer": row.layer, "step": row.step,
            "positions": [int(p) for p in positions], "past": len(sub.past_token_ids),
            "fused_attention": fused_attention(sub), "numerics": engine.numerics, "kv_dtype": engine.kv_dtype,
            "ggml_simd": getattr(engine, "ggml_simd", None),
            "qk_rows": proxy.qk_rows, "config": cfg.to_dict(), "dims": dims, "inputs": sorted(read),
            "weights": case_weights, "masked_by": "visible.npy" if tensor == "kq" else None}
    return case, arrays


def _operation(engine, get, layer, tensor, ids, fused, past, positions, cp):
    if layer is None:
        return model_outputs(engine, last_row(get) if cp == "9" else get, only={tensor}).get(tensor)
    return local_outputs(engine, get, layer, ids, fused_attention=fused, past=past, positions=positions,
                         only={tensor}).get(tensor)


def _finish(out, entry, dims, cp, neox):
    """The operation's output as the comparison saw it: canonical pair order; the last row for checkpoint 9."""
    if cp == "9":
        out = out[-1]
    if neox:
        out = to_canonical(out, entry, {"rope_pairs": "neox"}, dims)
    return np.asarray(out)


def _weight_files(engine, layer, name, v) -> tuple[dict, dict]:
    """-> (how the case reads the weight, {relative file: array}). Float arrays as they are; ggml's matrices
    as the GGUF blocks they were built from (type and shape beside them)."""
    if isinstance(v, np.ndarray) or (hasattr(v, "__array__") and not hasattr(v, "qtype")):
        return {"kind": "array"}, {f"weights/{name}.npy": engine.backend.to_numpy(v)}
    qtype = getattr(v, "qtype", None)
    if qtype in ("F32", "F16") and hasattr(v, "w"):
        return {"kind": "float_matrix", "qtype": qtype}, {f"weights/{name}.npy": np.asarray(v.w)}
    if qtype is not None and engine.path is not None and engine.path.is_file():
        qts = qtensors_of(engine.config, open_reader(engine.path))
        qt = qts.get("output" if layer is None and name == "output" else (layer, name))
        if qt is not None:
            return ({"kind": "blocks", "qtype": qt.qtype, "shape": list(qt.shape)},
                    {f"weights/{name}.blocks.npy": np.ascontiguousarray(qt.blocks)})
    raise HarnessError(f"no repro: the weight {name} is a {type(v).__name__}, which the repro cannot store")


# -- reading a repro back ------------------------------------------------------------------------------------
def load(folder) -> dict:
    """case.json of a repro folder, its file names checked (check_names): nothing it names leaves the folder."""
    folder = Path(folder)
    p = folder / "case.json"
    try:
        case = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise HarnessError(f"{p}: not a repro case ({e})") from None
    if not isinstance(case, dict):
        raise HarnessError(f"{p}: not a repro case (a JSON object is required)")
    check_names(case, p)
    case["folder"] = folder
    return case


def _plain_name(name, what: str, where) -> str:
    """A name the repro turns into a file name is a plain one: a non-empty string, no path separator, no '..',
    not absolute, no NUL, so the file it names lies inside the repro folder."""
    if not isinstance(name, str) or not name:
        raise HarnessError(f"{where}: {what} {name!r} is not a file name")
    if "/" in name or "\\" in name or ".." in name or "\0" in name or Path(name).is_absolute():
        raise HarnessError(f"{where}: {what} {name!r} would leave the repro folder (a plain name is required: no "
                           f"'..', no path separator, not absolute)")
    return name


def check_names(case: dict, where) -> None:
    """Every name case.json turns into a path (inputs, weights, masked_by) is a plain name (_plain_name)."""
    inputs, weights = case.get("inputs", []), case.get("weights", {})
    if not isinstance(inputs, list) or not isinstance(weights, dict):
        raise HarnessError(f"{where}: inputs must be a list and weights an object of names")
    for n in inputs:
        _plain_name(n, "input name", where)
    for n, how in weights.items():
        _plain_name(n, "weight name", where)
        if not isinstance(how, dict):
            raise HarnessError(f"{where}: weight {n!r}: an object with its kind is required")
    if case.get("masked_by") is not None:
        _plain_name(case["masked_by"], "mask file", where)


def _engine(case):
    """The reference engine of the repro: the model's settings and only the weights the operation reads."""

    folder, c = case["folder"], dict(case["config"])
    for k in ("local_layers", "rope_freq_factors"):
        c[k] = tuple(c[k]) if c[k] is not None else None
    layer = case["layer"]
    if layer is not None:                        # a cache for layers 0..layer only: the layer's own tables
        c["n_layers"] = layer + 1
        c["local_layers"] = c["local_layers"][:layer + 1] if c["local_layers"] else None
    cfg = Config(**c)
    weights, lanes = {}, SIMD_LANES[case.get("ggml_simd") or "avx2"]
    for name, how in case["weights"].items():
        if how["kind"] == "array":
            weights[name] = np.load(folder / "weights" / f"{name}.npy")
        elif how["kind"] == "float_matrix":
            weights[name] = FloatMatrix(np.load(folder / "weights" / f"{name}.npy"), how["qtype"], lanes)
        else:
            qt = QTensor(how["qtype"], tuple(how["shape"]), np.load(folder / "weights" / f"{name}.blocks.npy"), name)
            weights[name] = matrix_of(qt) if case["numerics"] == "ggml" else qt.dequantize()
    ggml = case["numerics"] == "ggml"
    backend = get_backend("numpy")
    n_ctx = max(case["positions"]) + 1
    lw = types.SimpleNamespace(**weights)
    eng = types.SimpleNamespace(config=cfg, xp=np, backend=backend, numerics=case["numerics"],
                                ops=make_ops(case["kv_dtype"], lanes) if ggml else backend.make_ops(layer_ops),
                                qk_rows=case["qk_rows"], weights=types.SimpleNamespace(
                                    layers={layer: lw} if layer is not None else {},
                                    tok_embd=weights.get("tok_embd"), out_norm=weights.get("out_norm"),
                                    output=weights.get("output")))
    eng.new_cache = lambda: Cache(np, cfg, n_ctx, kv_dtype=case["kv_dtype"], ops=eng.ops)
    return eng


def run(case) -> np.ndarray:
    """The reference's operation on the stored inputs, as the comparison saw its output."""
    folder = case["folder"]
    held = {n: np.load(folder / "inputs" / f"{n}.npy") for n in case["inputs"]}

    def get(name, layer):
        return held.get(f"{name}.layer{layer}" if layer is not None else name)
    ids = list(range(len(case["positions"]))) if "tok_embd" in case["weights"] else [0] * len(case["positions"])
    eng = _engine(case)
    out = _operation(eng, get, case["layer"], case["tensor"], ids, case["fused_attention"], case["past"],
                     np.asarray(case["positions"]), case["checkpoint"])
    if out is None:
        raise HarnessError(f"{folder}: the stored inputs do not feed {case['tensor']}")
    entry = catalogue()[(case["checkpoint"], case["tensor"])]
    out = _finish(out, entry, case["dims"], case["checkpoint"],
                  case["qk_rows"] == "neox" and bool(entry.get("rope_pairs")))
    if case.get("masked_by"):
        vis = np.load(folder / case["masked_by"])
        out = np.where(vis[None], out, np.float32(0)).astype(np.float32)
    return out


def _figures(m) -> str:
    return f"NMSE {fmt(m.get('nmse'))}, max abs {fmt(m.get('max_abs'))}, cosine {fmt_cos(m.get('cosine'))}"


def check_reference(case):
    """The operation run again gives the stored reference output (the repro holds what the op read)."""
    got, want = run(case), np.load(case["folder"] / "reference_output.npy")
    m = compare(got, want)
    assert got.shape == want.shape and m["nmse"] <= 1e-12, (
        f"the reference's operation for {case['what']} no longer gives the stored output: {_figures(m)}")


def check_subject(case):
    """The subject's output against the reference's operation on the subject's inputs, under the band."""
    m = compare(np.load(case["folder"] / "subject_output.npy"), run(case))
    assert within(m, case["band"]), (
        f"{case['subject']}: {case['what']}: local {_figures(m)} outside the band {json.dumps(case['band'])} "
        f"(the bundle measured {_figures(case['figures'])})")
