"""The llorch-dump format: any engine's intermediate tensors, in a safetensors file, named by checkpoint.

Format (llorch_ref/checkpoints/DUMP_FORMAT.md, manifest schema llorch_ref/checkpoints/dump.schema.json):

- tensor names `cp<id>.<tensor>` (model checkpoints) or `cp<id>.<tensor>.layer<L>` (layer checkpoints);
  the tensors each checkpoint knows are listed in its spec file under "dump" (with their canonical shape);
- the manifest is JSON under the safetensors metadata key "llorch.manifest" (or, for writers that cannot
  write metadata, in a sidecar file `<dump>.manifest.json`): format, engine, model, token_ids, layouts;
- layouts say how the engine's arrays differ from the canonical one, and the reader undoes them:
  rope_pairs "adjacent" (pairs (2i, 2i+1), llama.cpp/GGUF rows) or "neox" (pairs (i, i + R/2), Hugging Face
  rows); heads "token_major" ([T, H, Hd]) or "head_major" ([H, T, Hd]); array_order "numpy" or "ggml"
  (shape listed innermost first, as ggml's ne[]: the reader reverses it, the bytes are the same).

`Recorder` writes dumps from NumPy, PyTorch, JAX or CuPy code; `load_dump` reads and validates them.
"""
from __future__ import annotations

import datetime as _dt
import functools
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .checkpoints import catalogue_path, load_specs
from .dtypes import KV_DTYPES, dtype_name
from .errors import DumpError, ParameterError
from .json_doc import check_schema, json_object
from .loaders.default_model import sha256_file
from .output_paths import check_output
from .tensor_file import read_tensors

FORMAT = "llorch-dump/3"   # 3: decode steps (.step<K> tensors, decode_token_ids); 2: declared arithmetic
FORMATS = ("llorch-dump/1", "llorch-dump/2", FORMAT)
MANIFEST_KEY = "llorch.manifest"
NAME_RE = re.compile(r"^cp(?P<cp>[0-9]+[A-Z]?)\.(?P<tensor>[a-z][a-z0-9_]*)(?:\.layer(?P<layer>[0-9]+))?$")
STEP_RE = re.compile(r"^(?P<base>.+)\.step(?P<step>[1-9][0-9]*)$")   # a decode step's tensor: <name>.step<K>
CANONICAL_LAYOUTS = {"rope_pairs": "adjacent", "heads": "token_major", "array_order": "numpy"}
# what our own forward records but no checkpoint compares (the Recorder's hook form skips exactly these)
NOT_A_CHECKPOINT = {"embd"}
SCORE_TENSORS = ("kq", "kq_soft_max")          # [H, T, S]: a long prompt holds them at sampled rows (score_rows)
FORWARD_NAMES = {"result_output": ("8", "logits")}


def schema_path() -> Path:
    return catalogue_path() / "dump.schema.json"


def catalogue(specs=None) -> dict:
    """-> {(checkpoint id, tensor name): {"scope", "shape", "dtype", "head_major"?, "rope_pairs"?, "derive"?}}.
    Read once per spec folder (every tensor lookup of a comparison consults it); do not mutate the result."""
    if specs is not None:
        return _build_catalogue(specs)
    return _catalogue_of(str(catalogue_path()))


@functools.lru_cache(maxsize=4)
def _catalogue_of(spec_dir: str) -> dict:
    return _build_catalogue(load_specs())


def _build_catalogue(specs) -> dict:
    out = {}
    for s in specs:
        for t in s.dump or []:
            out[(s.id, t["name"])] = {**t, "scope": s.scope}
    return out


def dump_name(checkpoint: str, tensor: str, layer: int | None = None) -> str:
    return f"cp{checkpoint}.{tensor}" + ("" if layer is None else f".layer{int(layer)}")


def _to_numpy(a) -> np.ndarray:
    """NumPy, PyTorch (any device, bf16 included), JAX or CuPy array -> a NumPy array (a copy)."""
    if hasattr(a, "detach"):                                  # torch.Tensor
        a = a.detach().to("cpu")
        if a.is_floating_point():
            a = a.float()
        return a.numpy().copy()
    if hasattr(a, "get") and type(a).__module__.startswith("cupy"):
        return a.get()
    return np.array(a, copy=True)


def model_sha256(path) -> str:
    """sha256 of a GGUF file; for a folder, sha256 over 'name sha256' lines of its config and weight files
    (Hugging Face safetensors, ONNX graphs and their external data)."""
    import hashlib

    p = Path(path)
    if p.is_dir():
        lines = [f"{f.name} {sha256_file(f)}" for f in sorted(p.iterdir())
                 if f.suffix in (".safetensors", ".json", ".onnx", ".data") and f.is_file()]
        return hashlib.sha256("\n".join(lines).encode()).hexdigest()
    return sha256_file(p)


class Recorder:
    """Collects an engine's checkpoint tensors and writes one dump.

        rec = Recorder("my-engine", "0.3.1", model_path="model.gguf", token_ids=ids, prompt=text,
                       layouts={"rope_pairs": "neox", "heads": "head_major"})
        rec.add("cp2.q_proj", q, layer=3)        # or rec.add("cp2.q_proj.layer3", q)
        rec.save("dump.safetensors")

    A Recorder is also a llorch-ref forward hook: rec(name, layer, array) takes llorch-ref's own tensor
    names (q_proj, kq, l_out, result_output, ...). Arrays are copied when added (float32 or int64).
    """

    def __init__(self, engine: str, version: str = "", *, model_path=None, model_sha256_: str | None = None,
                 token_ids=None, prompt: str | None = None, layouts: dict | None = None, notes: str | None = None,
                 extra: dict | None = None, rows=None, keep=None, store=None, score_rows=None):
        """store: where the tensors go (default a dict in memory; a tensor_file.SpillStore writes each one to a
        temporary file as it is added, for a long prompt's dump). score_rows: the rows (among `rows`) at which
        the attention scores are kept (default: every row kept)."""
        self.engine, self.version = str(engine), str(version)
        self.keep = None if keep is None else {tuple(k) for k in keep}    # (cp, tensor) to keep; None: all
        self.rows = None if rows is None else [int(r) for r in rows]     # the prompt rows held (manifest "rows")
        self.score_rows = None if score_rows is None else [int(r) for r in score_rows]
        self.model_path = None if model_path is None else str(model_path)
        self._model_sha = model_sha256_
        self.token_ids = None if token_ids is None else [int(t) for t in token_ids]
        self.prompt, self.notes, self.extra = prompt, notes, dict(extra or {})
        bad = set(layouts or {}) - set(CANONICAL_LAYOUTS)
        if bad:
            raise DumpError(f"unknown layout key(s) {', '.join(sorted(bad))}; known: {', '.join(CANONICAL_LAYOUTS)}")
        self.layouts = {**CANONICAL_LAYOUTS, **(layouts or {})}
        self.tensors: dict[str, np.ndarray] = {} if store is None else store
        self._cat = catalogue()
        self._by_tensor = {}
        for cp, t in self._cat:
            self._by_tensor.setdefault(t, []).append(cp)

    def add(self, name: str, array, layer: int | None = None, step: int = 0):
        """step: 0 for the prompt's forward, K >= 1 for the K-th decode step (its token decode_token_ids[K-1])."""
        if layer is not None:
            name = f"{name}.layer{int(layer)}"
        if step:
            name = f"{name}.step{int(step)}"
        cp, t, _ = _parse_name(split_step(name)[0], self._cat)        # raises on an unknown name
        if self.keep is not None and (cp, t) not in self.keep:
            return
        src = array if isinstance(array, np.ndarray) else _to_numpy(array)
        a = self._kept_rows(cp, t, src, step)
        if self._cat[(cp, t)]["dtype"] == "int":
            if a.dtype.kind == "f" and not np.array_equal(a, np.round(a)):
                raise DumpError(f"tensor {name!r} holds token ids: got non-integer values")
            a = a.astype(np.int64, copy=False)
        else:
            a = a.astype(np.float32, copy=False)
        if isinstance(array, np.ndarray) and type(self.tensors) is dict and np.may_share_memory(a, array):
            a = a.copy()                 # held in memory: a copy (a store on disk writes it out at once)
        self.tensors[name] = a           # returns None: safe to call from torch hooks (a return value replaces outputs)

    def _kept_rows(self, cp, t, a, step):
        """With rows, an array of the prompt's forward in the canonical order that still holds every row is cut
        to the rows kept (one already cut, e.g. a forward's last layer asked for these rows only, is kept)."""
        e = self._cat[(cp, t)]
        ax = token_axis(e)
        if self.score_rows is not None and t in SCORE_TENSORS and not step:
            return self._score_rows_of(e, a, ax)
        if (self.rows is None or step or ax is None or a.ndim <= ax or self.token_ids is None
                or len(self.rows) == len(self.token_ids) or a.shape[ax] != len(self.token_ids)
                or self.layouts["array_order"] != "numpy" or (e.get("head_major") and self.layouts["heads"] != "token_major")):
            return a
        return select_rows(e, a, self.rows)

    def _score_rows_of(self, e, a, ax):
        """Attention scores of every row, or of the rows held -> the score rows (one already cut is kept)."""
        n = a.shape[ax] if a.ndim > ax else 0
        held = list(range(len(self.token_ids))) if self.rows is None else self.rows
        if n == len(self.score_rows) or self.layouts["array_order"] != "numpy":
            return a
        if n == len(self.token_ids):
            return select_rows(e, a, self.score_rows)
        if n == len(held):
            where = {r: i for i, r in enumerate(held)}
            return select_rows(e, a, [where[r] for r in self.score_rows])
        return a

    def __setitem__(self, name, array):
        self.add(name, array)

    def at_step(self, step: int):
        """-> a llorch-ref forward hook (name, layer, array) that records into decode step `step`."""
        return lambda name, layer, array: self(name, layer, array, step=step)

    def __call__(self, name: str, layer, array, step: int = 0):
        """llorch-ref's recorder signature: our forward's tensor names, every row of the forward (only the
        Recorder's rows are kept of the prompt's forward, step 0)."""
        if name in NOT_A_CHECKPOINT:
            return
        if name in FORWARD_NAMES:
            cp, t = FORWARD_NAMES[name]
        else:
            cps = self._by_tensor.get(name)
            if not cps:
                raise DumpError(f"no checkpoint records a tensor named {name!r}")
            cp, t = cps[0], name
        self.add(dump_name(cp, t, layer), array, step=step)

    def manifest(self) -> dict:
        if self.token_ids is None:
            raise DumpError("the Recorder needs token_ids (the ids the engine ran) before it can be saved")
        sha = self._model_sha
        if sha is None:
            sha = model_sha256(self.model_path) if self.model_path and Path(self.model_path).exists() else "unknown"
        m = {"format": FORMAT, "engine": {"name": self.engine, "version": self.version},
             "model": {"path": self.model_path or "", "sha256": sha}, "token_ids": self.token_ids,
             "layouts": self.layouts, "created_utc": _dt.datetime.now(_dt.timezone.utc).isoformat()}
        if self.prompt is not None:
            m["prompt"] = self.prompt
        if self.rows is not None:
            m["rows"] = self.rows
        if self.score_rows is not None:
            m["score_rows"] = self.score_rows
        if self.notes:
            m["notes"] = self.notes
        m.update(self.extra)
        return m

    def to_dump(self) -> "Dump":
        man = self.manifest()
        validate_manifest(man, "<recorder>")
        held = dict(self.tensors) if type(self.tensors) is dict else self.tensors
        return Dump(manifest=man, tensors=held, source="<recorder>")

    def save(self, path, overwrite: bool = True) -> Path:
        """Write the dump atomically (a unique staging file renamed into place); an existing file is
        replaced only with overwrite, and never a folder, a special file or the model it was made from."""
        from safetensors.numpy import save_file

        man = self.manifest()
        validate_manifest(man, str(path))
        out = check_output(path, overwrite=overwrite, inputs=[self.model_path] if self.model_path else [])
        with out.staged_file() as tmp:
            save_file({k: np.ascontiguousarray(v) for k, v in self.tensors.items()}, str(tmp),
                      metadata={MANIFEST_KEY: json.dumps(man)})
        return out.path


def split_step(name: str) -> tuple[str, int]:
    """'cp2.q_proj.layer3.step2' -> ('cp2.q_proj.layer3', 2); a name without a step suffix -> (name, 0)."""
    m = STEP_RE.match(name)
    return (m["base"], int(m["step"])) if m else (name, 0)


def _parse_name(name: str, cat: dict):
    m = NAME_RE.match(name)
    if not m:
        raise DumpError(f"tensor name {name!r} is not cp<id>.<tensor>[.layer<L>] (e.g. cp2.q_proj.layer3)")
    cp, t, layer = m["cp"], m["tensor"], m["layer"]
    known = sorted(n for c, n in cat if c == cp)
    if not known:
        raise DumpError(f"tensor {name!r}: no checkpoint {cp} (known: {', '.join(sorted({c for c, _ in cat}))})")
    if (cp, t) not in cat:
        raise DumpError(f"tensor {name!r}: checkpoint {cp} has no tensor {t!r} (known: {', '.join(known)})")
    scope = cat[(cp, t)]["scope"]
    if scope == "layer" and layer is None:
        raise DumpError(f"tensor {name!r}: checkpoint {cp} is per layer: name it {name}.layer<L>")
    if scope != "layer" and layer is not None:
        raise DumpError(f"tensor {name!r}: checkpoint {cp} is not per layer: drop the .layer suffix")
    return cp, t, None if layer is None else int(layer)


def validate_manifest(man, where: str):
    """man against the dump format's schema (DumpError naming the first place that breaks it)."""
    check_schema(man, json.loads(schema_path().read_text()), f"{where}: manifest", DumpError)


@dataclass
class Dump:
    manifest: dict
    tensors: dict                  # name -> array as stored (engine layout)
    source: str = ""
    index: dict = field(default_factory=dict)     # (cp, tensor, layer) -> name

    def __post_init__(self):
        cat = catalogue()
        self.steps = {}                # K -> {name without .stepK: array} for decode steps
        for name in [n for n in self.tensors if split_step(n)[1]]:
            base, k = split_step(name)
            _parse_name(base, cat)
            self.steps.setdefault(k, {})[base] = self.tensors.pop(name)
        rows = self.manifest.get("rows")
        if rows is not None and (rows != sorted(set(rows)) or rows[-1] >= len(self.manifest["token_ids"])):
            raise DumpError(f"{self.source}: 'rows' must be increasing indices into token_ids "
                            f"(0..{len(self.manifest['token_ids']) - 1})")
        sr = self.manifest.get("score_rows")
        if sr is not None and (not isinstance(sr, list) or not sr or not set(sr) <= set(self.rows)
                               or sr != sorted(set(sr))):
            raise DumpError(f"{self.source}: 'score_rows' must be increasing indices among the rows held")
        fed = self.manifest.get("decode_token_ids") or []
        if self.steps and max(self.steps) > len(fed):
            raise DumpError(f"{self.source}: tensors of decode step {max(self.steps)}, but the manifest's "
                            f"decode_token_ids name {len(fed)} step(s)")
        for k, held in self.steps.items():
            for name, a in held.items():
                self._check_dtype(f"{name}.step{k}", a, _parse_name(name, cat), cat)
        lazy = getattr(self.tensors, "kind", None)          # a file's tensors: checked without reading them
        for name in list(self.tensors):
            key = _parse_name(name, cat)
            self._check_dtype(name, lazy(name) if lazy else self.tensors[name], key, cat)
            shape = self.tensors.shape(name) if lazy else list(np.shape(self.tensors[name]))
            if 0 in shape and cat[key[:2]]["dtype"] == "int":
                continue                              # no tokens (e.g. a greedy run of 0 tokens): not held
            if 0 in shape:
                raise DumpError(f"{self.source}: tensor {name!r} is empty (shape {shape})")
            self.index[key] = name
        if ("0", "token_ids", None) in self.index and "prompt" not in self.manifest:
            raise DumpError(f"{self.source}: cp0.token_ids is the engine's tokenization of a prompt, but the "
                            f"manifest has no 'prompt'")

    def _check_dtype(self, name, a, key, cat):
        kind = a if isinstance(a, str) else np.asarray(a).dtype.kind
        what = {"f": "floats", "i": "integers", "u": "integers", "b": "booleans"}.get(kind, f"kind {kind!r}")
        if cat[key[:2]]["dtype"] == "int" and kind not in "iu":
            raise DumpError(f"{self.source}: tensor {name!r} must hold integers (token ids), not {what}")
        if cat[key[:2]]["dtype"] == "float" and kind != "f":
            raise DumpError(f"{self.source}: tensor {name!r} must hold floating-point values, not {what} "
                            f"(an engine's activations are never integers)")

    @property
    def engine(self) -> str:
        e = self.manifest["engine"]
        return f"{e['name']} {e['version']}".strip()

    @property
    def arithmetic(self) -> dict | None:
        """What the engine declares it does with activations and caches: {"numerics": "exact" (float32 on
        dequantized weights) | "ggml" (llama.cpp's activation quantization and order), "kv_dtype": "float32" |
        "float16" (f32/f16 of earlier files read as those)}; None for dumps that declare nothing (format /1)."""
        ar = self.manifest.get("arithmetic")
        return None if ar is None else {**ar, "kv_dtype": dtype_name(ar["kv_dtype"], KV_DTYPES, "kv_dtype")}

    @property
    def layouts(self) -> dict:
        return self.manifest["layouts"]

    @property
    def token_ids(self) -> list:
        return list(self.manifest["token_ids"])

    @property
    def rows(self) -> list:
        """The rows of the forward this dump holds (indices into token_ids): all of them unless it says."""
        rows = self.manifest.get("rows")
        return list(range(len(self.token_ids))) if rows is None else list(rows)

    @property
    def decode_token_ids(self) -> list:
        """The tokens fed one per decode step after token_ids (teacher-forced); [] for a prompt-only dump."""
        return list(self.manifest.get("decode_token_ids") or [])

    def step_view(self, k: int) -> "Dump":
        """Decode step k (1-based) as a dump of its own: one token fed after the prompt and the k-1 tokens
        before it (past_token_ids), holding that step's tensors under their plain names."""
        fed = self.decode_token_ids
        man = {key: v for key, v in self.manifest.items() if key not in ("decode_token_ids", "rows", "score_rows")}
        man.update(token_ids=fed[k - 1:k], past_token_ids=self.past_token_ids + self.token_ids + fed[:k - 1])
        man.pop("prompt", None)
        return Dump(manifest=man, tensors=dict(self.steps.get(k, {})), source=f"{self.source} (decode step {k})")

    @property
    def past_token_ids(self) -> list:
        """Ids already in the cache when this forward ran (a decode step); [] for a fresh cache."""
        return list(self.manifest.get("past_token_ids") or [])

    def has(self, cp, tensor, layer=None) -> bool:
        return (cp, tensor, layer) in self.index

    def has_step_logits(self, k: int) -> bool:
        """Whether decode step k holds its logits (cp8.logits.step<k>)."""
        return "cp8.logits" in self.steps.get(k, {})

    def raw(self, cp, tensor, layer=None):
        return np.asarray(self.tensors[self.index[(cp, tensor, layer)]])

    def read_rows(self, cp, tensor, a: int, b: int, n_rows: int, layer=None) -> np.ndarray:
        """Rows a..b-1 of a [n_rows, X] tensor as [b - a, X], read alone where the tensors lie in a file or a
        store (a long prompt's logits are compared a span of rows at a time). The bytes of such a tensor are
        the same in NumPy and ggml order."""
        name = self.index[(cp, tensor, layer)]
        if hasattr(self.tensors, "read_rows"):
            return self.tensors.read_rows(name, a, b, n_rows)
        return np.asarray(self.tensors[name]).reshape(n_rows, -1)[a:b]

    def shape_of(self, cp, tensor, layer=None) -> list:
        """The stored shape, without reading the tensor where it lies in a file or a store."""
        name = self.index[(cp, tensor, layer)]
        if hasattr(self.tensors, "shape"):
            return list(self.tensors.shape(name))
        return list(np.shape(self.tensors[name]))

    @property
    def score_rows(self) -> list:
        """The rows (indices into token_ids, among `rows`) at which the attention scores (kq, kq_soft_max) are
        held: `rows` unless the manifest samples fewer (a long prompt: its T x S scores are large)."""
        sr = self.manifest.get("score_rows")
        return self.rows if sr is None else list(sr)

    def get(self, cp, tensor, layer=None, dims=None, layouts=None):
        """The tensor in the canonical layout (None if the dump does not hold it). `layouts` overrides the
        manifest's declaration (used to test whether another declaration would fit better)."""
        if (cp, tensor, layer) not in self.index:
            return None
        entry = catalogue()[(cp, tensor)]
        return to_canonical(self.raw(cp, tensor, layer), entry, layouts or self.layouts, dims)


def _dims_of(expr: str, dims: dict) -> list:
    out = []
    for part in expr.split(","):
        n = 1
        for f in part.split("*"):
            if f not in dims:
                return None
            n *= int(dims[f])
        out.append(n)
    return out


def to_canonical(a, entry: dict, layouts: dict, dims: dict | None = None) -> np.ndarray:
    """Undo the declared layouts: ggml order -> NumPy order, head-major -> token-major, NeoX pairs ->
    adjacent pairs. dims: {"T", "S", "H", "KV", "Hd", "D", "F", "V", "R"} (R = rotary dims)."""
    a = np.asarray(a)
    if layouts.get("array_order") == "ggml":
        a = a.reshape(a.shape[::-1])
    hm = entry.get("head_major")
    if hm and layouts.get("heads") == "head_major" and a.ndim == len(hm.split(",")):
        canon = entry["shape"].replace("*", ",").split(",")          # canonical dims, merged groups split
        src = hm.split(",")
        if sorted(src) == sorted(canon):
            a = a.transpose([src.index(d) for d in canon])
            want = _dims_of(entry["shape"], {d: n for d, n in zip(canon, a.shape)})
            a = a.reshape(want)
    if entry.get("rope_pairs") and layouts.get("rope_pairs") == "neox" and a.ndim >= 1:
        hd = a.shape[-1]
        r = int((dims or {}).get("R", hd))
        if r % 2 == 0 and r <= hd:
            a = a[..., np.concatenate([_neox_of_adjacent(r), np.arange(r, hd)])]
    return a


def neox_pairs(a, r: int):
    """Canonical (adjacent) rotary pairs -> NeoX pairs (i, i + R/2) on the last axis: to_canonical's inverse,
    for an engine whose Q/K rows are in NeoX order (Gemma, a Hugging Face folder)."""
    a = np.asarray(a)
    out = a.copy()
    out[..., _neox_of_adjacent(r)] = a[..., :r]
    return out


def _neox_of_adjacent(r: int) -> np.ndarray:
    """Adjacent rotary index j (pair j // 2, member j % 2) -> its NeoX index (pair i at i and i + R/2)."""
    j = np.arange(r)
    return (j // 2) + (j % 2) * (r // 2)


def expected_shape(entry: dict, dims: dict):
    return _dims_of(entry["shape"], dims)


def token_axis(entry: dict) -> int | None:
    """The axis of a catalogue tensor's canonical shape that runs over the forward's rows (T), or None."""
    dims = entry["shape"].split(",")
    return next((i for i, d in enumerate(dims) if d == "T" or d.startswith("T*")), None)


def parse_rows(spec: str | None, n: int) -> list[int] | None:
    """--rows SPEC for an n-token prompt -> sorted row indices, or None for all. SPEC: all, last, every:K
    (0, K, 2K, ... and the last), or a comma list of indices and inclusive ranges A-B."""
    if spec is None or spec.strip() == "all":
        return None
    spec = spec.strip()
    if spec == "last":
        return [n - 1]
    if spec.startswith("every:"):
        try:
            k = int(spec[6:])
        except ValueError:
            k = 0
        if k < 1:
            raise ParameterError(f"--rows {spec}: every:K needs an integer K >= 1")
        return sorted(set(range(0, n, k)) | {n - 1})
    out = set()
    for part in spec.split(","):
        a, _, b = part.strip().partition("-")
        try:
            lo, hi = int(a), int(b) if b else int(a)
        except ValueError:
            raise ParameterError(f"--rows {spec}: give all, last, every:K or indices such as 0,5,100-199") from None
        if not 0 <= lo <= hi < n:
            raise ParameterError(f"--rows {spec}: {part.strip()} is outside the prompt's rows 0..{n - 1}")
        out.update(range(lo, hi + 1))
    return sorted(out)


def check_rows(rows, n: int) -> list[int] | None:
    """rows of an n-token forward to keep -> sorted unique indices with the last row always among them (decode
    steps and generation start from it); None: all. ParameterError if one is out of range."""
    if rows is None:
        return None
    rows = sorted({int(r) for r in rows})
    if rows and (rows[0] < 0 or rows[-1] >= n):
        raise ParameterError(f"rows must be indices into the {n} prompt tokens (0..{n - 1}); got "
                             f"{rows[0]}..{rows[-1]}")
    return sorted(set(rows) | {n - 1})


def select_rows(entry: dict, a, rows):
    """A canonical tensor of every row -> the rows `rows` (indices) only; tensors without a T axis as they are."""
    ax = token_axis(entry)
    return a if ax is None or rows is None else np.take(np.asarray(a), np.asarray(rows, dtype=np.int64), axis=ax)


def load_dump(path) -> Dump:
    """Read and validate a dump file: manifest against the JSON Schema, every tensor name against the specs."""
    p = Path(path)
    if not p.is_file():
        raise DumpError(f"{p}: no such dump file")
    try:
        tensors, meta = read_tensors(p)
    except OSError as e:
        raise DumpError(f"{p}: cannot read it ({e.strerror or e})") from None
    side = p.with_name(p.name + ".manifest.json")
    if MANIFEST_KEY in meta:
        man = json_object(meta[MANIFEST_KEY], f"{p}: metadata '{MANIFEST_KEY}'", DumpError)
    elif side.is_file():
        if side.stat().st_size > 16 * 2**20:
            raise DumpError(f"{side}: a manifest over 16 MiB")
        man = json_object(side.read_bytes(), str(side), DumpError)
    else:
        raise DumpError(f"{p}: no manifest (metadata key '{MANIFEST_KEY}' or sidecar {side.name})")
    validate_manifest(man, str(p))
    return Dump(manifest=man, tensors=tensors, source=str(p))


def capture_invariance(captured, uncaptured, chunk: int = 32) -> dict:
    """Logits of the captured run against a run without the capture: they should be equal (a capture is an
    observer); a difference is reported in the manifest and, by the comparison, as a warning. Compared a span
    of rows at a time (a long prompt's logits are large; the maximum is the same)."""
    a, b = np.asarray(captured), np.asarray(uncaptured)
    if a.shape != b.shape:
        d = float("inf")
    else:
        a2, b2 = a.reshape(a.shape[0], -1) if a.ndim else a.reshape(1, 1), b.reshape(b.shape[0], -1) if b.ndim else b.reshape(1, 1)
        d = max((max_abs_diff(a2[i:i + chunk], b2[i:i + chunk]) for i in range(0, a2.shape[0], chunk)), default=0.0)
    return invariance_figure(d)


def max_abs_diff(a, b, rows: int = 32) -> float:
    """max |a - b| in float64 (0 for empty arrays), `rows` rows at a time (a batch of a long prompt's logits in
    float64 would take four times its float32 size, several times over)."""
    a, b = np.asarray(a), np.asarray(b)
    if not a.size:
        return 0.0
    a2, b2 = a.reshape(a.shape[0], -1) if a.ndim > 1 else a[None], b.reshape(b.shape[0], -1) if b.ndim > 1 else b[None]
    return max(float(np.max(np.abs(a2[i:i + rows].astype(np.float64) - b2[i:i + rows].astype(np.float64))))
               for i in range(0, a2.shape[0], rows))


def invariance_figure(d: float) -> dict:
    return {"logits_max_abs_diff": float(d),
            "what": "logits of the captured forward minus those of the same forward without the capture"}


def default_score_rows(rows: list, n_tokens: int, limit: int = 1024, n_sampled: int = 128) -> list | None:
    """The query rows at which a dump holds its attention scores by default: every row held (None) while the
    T x S scores are small (n_tokens <= limit); else about n_sampled of the rows held, evenly spaced, the last
    among them."""
    if n_tokens <= limit or len(rows) <= n_sampled:
        return None
    step = -(-len(rows) // n_sampled)
    return sorted(set(rows[::step]) | {rows[-1]})
