"""Sweeps: a matrix of checks over prompt lengths, decode steps and a subject's settings, each cell one
`run_subject` (local, teacher-forced figures) with its verdict; the first failing cell shrunk to the smallest
case that still fails the same way; cells run in-process or as Ray tasks on actors that load the engines once.

The rules:

- A cell is (prompt length, decode steps, settings). Its prompt is the sweep text's token ids, cut or repeated
  to that length; the subject runs it with that many decode steps (the reference teacher-forced on its tokens).
- A cell's status is its verdict's (PASS, FAIL, INCOMPLETE); a subject that raises fails its cell; a cell the
  harness cannot judge (a LlorchError of the comparison: no bands for its arithmetic) is INCOMPLETE, with the
  reason. The prompt's tokenization (cp0) does not apply: a cell's tokens are ids, not a text.
- The sweep exits 1 when a cell fails, 3 when one is INCOMPLETE and none fails, 0 else.
- Shrinking (as property-based testing shrinks, greedy and deterministic): from the failing cell that is
  smallest (simplest settings, fewest steps, shortest prompt, in that order), each axis in turn (length, steps,
  then each setting) takes the smallest value below its own that still fails with the same first divergence
  (checkpoint and tensor), until no axis moves. Lengths, steps and n_seq try every integer below, other
  settings the values listed before (the first listed is the simplest); at most `shrink_budget` cells beyond
  the matrix are run.
- n_seq (a setting of the llamacpp subject and of any subject that takes it): the cell's sequences run in one
  batch, sequence j's prompt the sweep text from its 7*j-th token on (harness/sweep_batch.py); each sequence is
  judged against the reference run of it alone, the cell by its first failing sequence.
"""
from __future__ import annotations

import itertools
import math
import os
import shlex
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..dtypes import KV_DTYPES, dtype_name
from ..errors import LlorchError, ParameterError
from ..references.engines import dump_llamacpp
from .bundle import write_bundle
from .ray_eval import check_cluster_address
from .run import declared_engine, run_subject
from .subject import as_dump, load_callable
from .sweep_batch import dump_llamacpp_batch, sequence_prompts
from .verdict import EXIT_CODES, FAIL, INCOMPLETE, PASS

# the sweep's text: its tokens are cut or repeated to each cell's length
SWEEP_TEXT = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the sun. "
              "The quick brown fox jumps over the lazy dog. The capital of France is Paris, and the capital of "
              "Italy is Rome. In 1969, 3 astronauts flew 384,400 km to the Moon and back again.")
LLAMACPP_SETTINGS = ("n_ubatch", "threads", "kv_dtype", "flash_attn", "n_seq")
BOUNDARY_BASES = (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
SHRINK_BUDGET = 64
COUNT_SETTINGS = ("n_seq",)      # settings shrunk as lengths are: every integer >= 1 below their own


class SweepError(LlorchError):
    """A sweep could not complete: a cell's comparison raised, or its Ray actors could not be kept."""


@dataclass(frozen=True)
class Cell:
    length: int
    steps: int
    settings: tuple = ()             # ((name, value), ...) in the order the settings are listed

    def label(self) -> str:
        """The cell in one short line: L<length> s<steps> name=value ..."""
        return " ".join([f"L{self.length}", f"s{self.steps}"] + [f"{k}={fmt_value(v)}" for k, v in self.settings])


@dataclass
class SweepSpec:
    subject: str
    model: str | None = None
    lengths: list = field(default_factory=lambda: [1])
    steps: list = field(default_factory=lambda: [0])
    settings: dict = field(default_factory=dict)          # name -> [values], the first the simplest
    text: str = SWEEP_TEXT
    backend: str | None = None
    threads: int | None = None
    require: str = "auto"
    shrink: bool = True
    shrink_budget: int = SHRINK_BUDGET


# ---- specs -------------------------------------------------------------------------------------------------------

def parse_int_list(spec: str, what: str, lowest: int) -> list[int]:
    """'1-40', '1,2,3,31-33', 'boundaries:N' -> sorted distinct integers, each >= lowest; ParameterError else."""
    spec = str(spec).strip()
    if spec.startswith("boundaries:"):
        n = _int(spec.split(":", 1)[1], what, lowest=1)
        return [x for x in boundaries(n) if x >= lowest]
    out = set()
    for part in spec.split(","):
        part = part.strip()
        a, dash, b = part.partition("-")
        if not part or (dash and not b):
            raise ParameterError(f"{what} {spec!r}: expected N, A-B, a comma list of them, or boundaries:N")
        lo, hi = _int(a, what, lowest), _int(b, what, lowest) if dash else None
        if hi is not None and hi < lo:
            raise ParameterError(f"{what} {spec!r}: the range {part} runs backwards")
        out |= set(range(lo, (hi if hi is not None else lo) + 1))
    return sorted(out)


def _int(text: str, what: str, lowest: int) -> int:
    """One integer >= lowest, or ParameterError naming the option."""
    try:
        x = int(str(text).strip())
    except ValueError:
        raise ParameterError(f"{what}: {text!r} is not an integer") from None
    if x < lowest:
        raise ParameterError(f"{what}: {x} is below {lowest}")
    return x


def boundaries(n: int) -> list[int]:
    """The lengths where engines switch kernels, up to n: 1, 2, 3, and B-1, B, B+1 for B = 8, 16, 32, ..."""
    out = {1, 2, 3}
    for b in BOUNDARY_BASES:
        out |= {b - 1, b, b + 1}
    return sorted(x for x in out if x <= n)


def parse_value(text):
    """A setting's value: an integer, on/true -> True, off/false -> False, else the text itself."""
    if not isinstance(text, str):
        return text
    t = text.strip()
    if t.lower() in ("on", "true", "yes"):
        return True
    if t.lower() in ("off", "false", "no"):
        return False
    try:
        return int(t)
    except ValueError:
        return t


def fmt_value(v) -> str:
    """A setting's value as the command line writes it (True -> on)."""
    return "on" if v is True else "off" if v is False else str(v)


def parse_setting(text: str) -> tuple[str, list]:
    """'NAME=V1,V2' -> (NAME, [values]); ParameterError for a malformed one."""
    name, eq, values = str(text).partition("=")
    name = name.strip()
    if not eq or not name.isidentifier() or not values.strip():
        raise ParameterError(f"--settings {text!r}: expected NAME=V1,V2,... (e.g. n_ubatch=512,7)")
    vals = [parse_value(v) for v in values.split(",")]
    if any(v == "" for v in vals) or len(set(map(repr, vals))) != len(vals):
        raise ParameterError(f"--settings {text!r}: empty or repeated values")
    return name, vals


def check_settings(subject: str, settings: dict) -> dict:
    """The llamacpp subject takes n_ubatch, threads, n_seq (integers >= 1), kv_dtype (f32/f16/float32/float16)
    and flash_attn (on/off); kv_dtype values are named in full. Other subjects take any names (n_seq, where
    given, integers >= 1: the sequences of one batch)."""
    if "n_seq" in settings and not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1
                                       for v in settings["n_seq"]):
        raise ParameterError("--settings n_seq: integers >= 1")
    if subject != "llamacpp":
        return settings
    out = {}
    for name, vals in settings.items():
        if name not in LLAMACPP_SETTINGS:
            raise ParameterError(f"--settings {name}: not a setting of the llamacpp subject "
                                 f"({', '.join(LLAMACPP_SETTINGS)})")
        if name in ("n_ubatch", "threads", "n_seq") and not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1
                                                       for v in vals):
            raise ParameterError(f"--settings {name}: integers >= 1")
        if name == "flash_attn" and not all(isinstance(v, bool) for v in vals):
            raise ParameterError("--settings flash_attn: on or off")
        out[name] = [dtype_name(str(v), KV_DTYPES, "--settings kv_dtype") for v in vals] if name == "kv_dtype" else vals
    return out


def load_toml(path) -> dict:
    """A sweep's TOML file -> the keyword arguments of make_spec and the outputs (json, report, junit, ray)."""
    import tomllib
    p = Path(path)
    try:
        data = tomllib.loads(p.read_text(encoding="utf-8"))
    except OSError as e:
        raise ParameterError(f"{path}: cannot read it ({e.strerror or e})") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ParameterError(f"{path}: not a TOML file ({e})") from None
    known = {"subject", "model", "lengths", "steps", "settings", "text", "backend", "threads", "require", "shrink",
             "json", "report", "junit", "ray"}
    bad = sorted(set(data) - known)
    if bad:
        raise ParameterError(f"{path}: unknown key(s) {', '.join(bad)} (known: {', '.join(sorted(known))})")
    if not isinstance(data.get("settings", {}), dict):
        raise ParameterError(f"{path}: settings is a table of NAME = [values]")
    data["settings"] = [f"{k}={','.join(map(fmt_value, v if isinstance(v, list) else [v]))}"
                        for k, v in data.get("settings", {}).items()]
    for k in ("lengths", "steps"):
        if isinstance(data.get(k), list):
            data[k] = ",".join(map(str, data[k]))
    return data


def make_spec(subject, model=None, lengths=None, steps="0", settings=(), text=None, backend=None, threads=None,
              require="auto", shrink=True, **_outputs) -> SweepSpec:
    """The sweep from its options (command line or TOML), every one checked: ParameterError names the first bad."""
    if not subject:
        raise ParameterError("give --subject llamacpp or MODULE:FUNCTION")
    if subject != "llamacpp" and ":" not in subject:
        raise ParameterError(f"--subject {subject!r}: llamacpp or MODULE:FUNCTION")
    if lengths is None:
        raise ParameterError("give --lengths (e.g. 1-40, 1,2,3,31-33 or boundaries:129)")
    parsed = dict(parse_setting(s) for s in settings)
    if len(parsed) != len(list(settings)):
        raise ParameterError("--settings: a name given twice")
    return SweepSpec(subject=subject, model=None if model is None else str(model),
                     lengths=parse_int_list(lengths, "--lengths", 1), steps=parse_int_list(steps, "--steps", 0),
                     settings=check_settings(subject, parsed), text=text or SWEEP_TEXT, backend=backend,
                     threads=threads, require=require, shrink=bool(shrink))


def cells_of(spec: SweepSpec) -> list[Cell]:
    """Every cell of the matrix: settings combinations outermost (in the order listed), then steps, then lengths."""
    names = list(spec.settings)
    combos = itertools.product(*(spec.settings[n] for n in names)) if names else [()]
    return [Cell(length, steps, tuple(zip(names, combo)))
            for combo in combos for steps in spec.steps for length in spec.lengths]


def cell_tokens(base: list[int], n: int) -> list[int]:
    """The first n ids of base repeated as often as needed."""
    return (list(base) * math.ceil(n / len(base)))[:n]


# ---- subjects ----------------------------------------------------------------------------------------------------

def make_subject(spec: str):
    """-> f(model_path, token_ids, steps, settings) -> Dump, or a list of Dumps (one per sequence) where the
    cell's n_seq > 1 and token_ids is then one list of ids per sequence. llamacpp: dump_llamacpp with the cell's
    settings (no greedy text: the decode steps are the generation checked), or with n_seq > 1
    dump_llamacpp_batch (the sequences in one batch); MODULE:FUNCTION: called as (model_path, token_ids,
    **settings), with decode_steps=N where N > 0, as the pytest plugin calls it; with n_seq > 1 it returns a
    list of dumps, one per sequence, in order."""
    if spec == "llamacpp":
        def llamacpp(model_path, ids, steps, settings):
            s = dict(settings)
            kw = {"n_ubatch": s.get("n_ubatch", 512), "n_threads": s.get("threads", 2),
                  "kv_dtype": s.get("kv_dtype", "float32"), "flash_attn": s.get("flash_attn", False)}
            if s.get("n_seq", 1) > 1:
                return [r.to_dump() for r in dump_llamacpp_batch(model_path, ids, decode_steps=steps, **kw)]
            return dump_llamacpp(model_path, token_ids=ids, n_greedy=0, decode_steps=steps, **kw).to_dump()
        return llamacpp
    fn = load_callable(spec)

    def call(model_path, ids, steps, settings):
        out = fn(model_path, list(ids), **({"decode_steps": steps} if steps else {}), **dict(settings))
        return [as_dump(o, spec) for o in out] if isinstance(out, (list, tuple)) else as_dump(out, spec)
    return call


# ---- running cells -------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Plan:
    """What a runner needs to run cells anywhere (picklable: it travels to Ray actors)."""
    subject: str
    model: str
    text: str
    backend: str | None = None
    threads: int | None = None
    require: str = "auto"
    bundle_dir: str | None = None
    argv: tuple = ()


class CellRunner:
    """Runs cells of one sweep: the subject resolved and the reference engines (one per arithmetic a dump
    declares) loaded once, reused by every cell."""

    def __init__(self, plan: Plan):
        import llorch_ref
        self.plan = plan
        self.engine = llorch_ref.load(plan.model, backend=plan.backend, threads=plan.threads)
        self.subject = make_subject(plan.subject)
        tok = self.engine.tokenizer
        self.base = tok.encode(plan.text) if tok is not None else list(range(1, min(64, self.engine.config.n_vocab)))
        self.engines = {}

    def reference(self, sub):
        """The reference engine in the arithmetic the dump declares, loaded once per declaration."""
        d = sub.arithmetic or {}
        key = (d.get("numerics"), d.get("kv_dtype"), d.get("ggml_simd"))
        if key not in self.engines:
            self.engines[key] = declared_engine(self.engine, sub)
        return self.engines[key]

    def run(self, cell: Cell) -> dict:
        """-> the cell's record: length, steps, settings, status, first divergence, reasons, seconds (and the
        bundle's folder, relative to bundle_dir, for a failing cell when the plan writes bundles). With n_seq
        > 1 every sequence is judged against the reference run of it alone: the cell takes the first failing
        sequence's verdict (else the first incomplete one's), named in `sequence`; `sequences` lists each
        sequence's status."""
        t0 = time.perf_counter()
        n_seq = int(dict(cell.settings).get("n_seq", 1))
        seqs = sequence_prompts(self.base, cell.length, n_seq)
        rec = {"length": cell.length, "steps": cell.steps, "settings": {k: v for k, v in cell.settings}}
        try:
            out = self.subject(str(self.engine.path), seqs[0] if n_seq == 1 else seqs, cell.steps, cell.settings)
            subs = [out] if n_seq == 1 else list(out)
            if len(subs) != n_seq:
                raise TypeError(f"{len(subs)} dumps returned for {n_seq} sequences")
        except Exception as e:            # the subject itself: its crash is this cell's failure
            return {**rec, "status": FAIL, "first_divergence": None, "raised": type(e).__name__,
                    "reasons": [f"the subject raised {type(e).__name__}: {e}"], "seconds": time.perf_counter() - t0}
        judged = []
        for j, sub in enumerate(subs):
            said = "" if n_seq == 1 else f"sequence {j} of {n_seq}: "
            try:
                res = run_subject(self.reference(sub), sub, require=self.plan.require, as_declared=False,
                                  subject_label=f"{sub.engine} ({self.plan.subject}, {cell.label()}"
                                                + ("" if n_seq == 1 else f", sequence {j}") + ")")
            except LlorchError as e:      # the harness cannot judge this cell (no bands for its arithmetic, ...)
                return {**rec, "status": INCOMPLETE, "first_divergence": None, **self.which(j, n_seq, None),
                        "reasons": [f"{said}the comparison could not be made: {e}"],
                        "seconds": time.perf_counter() - t0}
            res.not_applicable = sorted(set(res.not_applicable) | {"cp0"})     # ids, not a text: nothing tokenized
            judged.append((j, res, res.verdict(), said))
        order = {FAIL: 0, INCOMPLETE: 1, PASS: 2}
        j, res, v, said = min(judged, key=lambda x: (order[x[2].status], x[0]))
        rec.update(status=v.status, first_divergence=v.first_divergence, reasons=[said + r for r in v.reasons],
                   **self.which(j if v.status != PASS else None, n_seq, [x[2].status for x in judged]))
        if v.status == FAIL and self.plan.bundle_dir:
            rec["bundle"] = self.bundle(res, cell)
        rec["seconds"] = time.perf_counter() - t0
        return rec

    @staticmethod
    def which(j, n_seq: int, statuses) -> dict:
        """The record's sequence fields (a cell of several sequences only): the sequence named, each one's status."""
        return {} if n_seq == 1 else {"sequence": j, **({"sequences": statuses} if statuses else {})}

    def bundle(self, res, cell: Cell) -> str:
        """A failing cell's proof bundle under the plan's bundle folder -> its folder name."""
        name = cell_id(cell)
        out = write_bundle(res, self.engine, out_dir=self.plan.bundle_dir, run_id=name, plot=False,
                           argv=list(self.plan.argv) or ["llorch-ref", "sweep"], tensors=False)
        return Path(out["dir"]).name


def cell_id(cell: Cell) -> str:
    """A file-name-safe name of a cell: L3-s0-n_ubatch-7."""
    safe = lambda p: "".join(c if c.isalnum() or c in "_." else "_" for c in str(p))     # noqa: E731
    return "-".join([f"L{cell.length}", f"s{cell.steps}"] + [f"{safe(k)}-{safe(fmt_value(v))}" for k, v in cell.settings])


class LocalExecutor:
    """Cells run one after the other in this process, on one runner."""

    def __init__(self, plan: Plan):
        self.runner = CellRunner(plan)
        self.where = f"in-process (pid {os.getpid()})"

    def run(self, cells, progress=None) -> list[dict]:
        out = []
        for c in cells:
            out.append(self.runner.run(c))
            if progress:
                progress(out[-1])
        return out

    def close(self):
        pass


# ---- shrinking -----------------------------------------------------------------------------------------------------

def failure_key(rec: dict):
    """What makes two failures the same: the first divergence's checkpoint and tensor (its step and layer may
    move), or the exception type a subject raised; None for a cell that does not fail."""
    if rec["status"] != FAIL:
        return None
    fd = rec.get("first_divergence")
    if fd is None:
        return ("raised", rec.get("raised"))
    return (str(fd["checkpoint"]), str(fd["tensor"]).split("@")[0])


def simplicity(cell: Cell, spec: SweepSpec) -> tuple:
    """The order of shrinking: settings (each by its place in the list), then steps, then length, smallest first."""
    return (tuple(spec.settings[k].index(v) for k, v in cell.settings), cell.steps, cell.length)


def shrink(spec: SweepSpec, results: dict, run_cell, budget: int = SHRINK_BUDGET) -> tuple[Cell, list]:
    """Greedy shrink (module docstring) of the simplest failing cell of `results` ({Cell: record}); run_cell(cell)
    -> record runs a cell beyond the matrix (each at most once). -> (the smallest failing cell, the cells run)."""
    failing = sorted((c for c, r in results.items() if r["status"] == FAIL), key=lambda c: simplicity(c, spec))
    # results is extended in place with the cells run here
    best = failing[0]
    key = failure_key(results[best])
    extra = []

    def fails(c: Cell) -> bool:
        if c not in results:
            if len(extra) >= budget:
                return False
            results[c] = run_cell(c)
            extra.append(c)
        return failure_key(results[c]) == key

    moved = True
    while moved:
        moved = False
        for cand in candidates(best, spec):
            if fails(cand):
                best, moved = cand, True
                break
    return best, extra


def candidates(cell: Cell, spec: SweepSpec):
    """Simpler neighbours of a cell, axis by axis (length, steps, each setting), smallest value first."""
    for n in range(1, cell.length):
        yield Cell(n, cell.steps, cell.settings)
    for s in range(0, cell.steps):
        yield Cell(cell.length, s, cell.settings)
    for i, (name, v) in enumerate(cell.settings):
        below = range(1, v) if name in COUNT_SETTINGS else spec.settings[name][:spec.settings[name].index(v)]
        for simpler in below:
            yield Cell(cell.length, cell.steps, cell.settings[:i] + ((name, simpler),) + cell.settings[i + 1:])


def repro_command(spec: SweepSpec, cell: Cell) -> str:
    """The one-cell sweep that reproduces a case: every option of the sweep, its axes set to the cell's values."""
    parts = ["llorch-ref", "sweep", "--subject", spec.subject]
    if spec.model:
        parts += ["--model", spec.model]
    parts += ["--lengths", str(cell.length), "--steps", str(cell.steps)]
    for k, v in cell.settings:
        parts += ["--settings", f"{k}={fmt_value(v)}"]
    if spec.text != SWEEP_TEXT:
        parts += ["--text", spec.text]
    if spec.backend:
        parts += ["--backend", spec.backend]
    if spec.threads:
        parts += ["--threads", str(spec.threads)]
    if spec.require != "auto":
        parts += ["--require", spec.require]
    return shlex.join(parts)


# ---- the sweep -----------------------------------------------------------------------------------------------------

@dataclass
class SweepResult:
    spec: SweepSpec
    cells: list                      # records of the matrix, in cells_of order
    shrink_cells: list               # records of the cells shrinking ran beyond the matrix
    smallest: dict | None            # {"cell": record, "command": str} of the smallest failing case
    where: str
    wall_s: float

    @property
    def status(self) -> str:
        """FAIL when a cell fails, INCOMPLETE when one is and none fails, PASS else."""
        got = {r["status"] for r in self.cells}
        return FAIL if FAIL in got else INCOMPLETE if INCOMPLETE in got else PASS

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.status]

    def to_json(self) -> dict:
        counts = {s: sum(r["status"] == s for r in self.cells) for s in (PASS, FAIL, INCOMPLETE)}
        spec = asdict(self.spec)
        return {"status": self.status, "exit_code": self.exit_code, "counts": counts, "where": self.where,
                "wall_s": self.wall_s, "spec": spec, "cells": self.cells, "shrink_cells": self.shrink_cells,
                "smallest_failing": self.smallest}


def run_sweep(spec: SweepSpec, executor, progress=None) -> SweepResult:
    """Every cell of the matrix on `executor` (LocalExecutor or a Ray one), then the shrink of the simplest
    failing cell, run on the same executor."""
    t0 = time.perf_counter()
    cells = cells_of(spec)
    records = executor.run(cells, progress=progress)
    smallest, extra = None, []
    if spec.shrink and any(r["status"] == FAIL for r in records):
        results = dict(zip(cells, records))
        best, extra = shrink(spec, results, lambda c: executor.run([c], progress=progress)[0], spec.shrink_budget)
        smallest = {"cell": results[best], "label": best.label(), "command": repro_command(spec, best)}
        extra = [results[c] for c in extra]
    return SweepResult(spec, records, extra, smallest, executor.where, time.perf_counter() - t0)


# ---- Ray -----------------------------------------------------------------------------------------------------------

MAX_ATTEMPTS = 4          # a cell whose actor died this many times is an error, not an endless loop


def _runner_class(ray):
    @ray.remote(num_cpus=1, max_restarts=0)
    class Runner:
        def __init__(self, plan):
            self.runner = CellRunner(plan)

        def run(self, cell):
            try:
                return self.runner.run(cell)
            except Exception as e:        # the comparison itself: the driver raises it as a SweepError
                return {"error": f"{type(e).__name__}: {e}"}

        def where(self):
            return {"pid": os.getpid(), "node": ray.get_runtime_context().get_node_id()}
    return Runner


class RayExecutor:
    """Cells as Ray tasks on actors that build a CellRunner once (the pattern of eval's --ray): a local Ray
    (address None) or a cluster's. An actor that dies has its cell given to another and a replacement started;
    each cell's record is kept once. close() shuts down a Ray this executor started."""

    def __init__(self, plan: Plan, address=None, n_actors: int | None = None):
        check_cluster_address(address)          # bounded: an unreachable address is refused before Ray starts
        try:
            import ray
            from ray.exceptions import ActorDiedError, RayActorError
        except ImportError as e:
            raise SweepError(f"--ray needs Ray: pip install 'llorch-ref[ray]' ({e})") from None
        self.ray, self.died = ray, (ActorDiedError, RayActorError)
        self.started_here = not ray.is_initialized()
        if self.started_here:
            try:
                ray.init(address=address or None, include_dashboard=False, log_to_driver=False,
                         logging_level="ERROR")
            except (ConnectionError, ValueError, RuntimeError) as e:
                raise SweepError(f"--ray {address or '(local)'}: cannot start or join Ray ({e})") from None
        self.plan, self.rerun, self.nodes = plan, 0, set()
        self.Runner = _runner_class(ray)
        n = max(1, n_actors or int(ray.cluster_resources().get("CPU", 1)))
        self.actors = [a for a in (self.new_actor() for _ in range(n)) if a is not None]
        if not self.actors:
            raise SweepError(f"{n} actors started, none alive: Ray cannot keep them")
        self.where = f"ray: {len(self.actors)} actors on {len(self.nodes)} node(s)"

    def new_actor(self):
        """A started actor (its engines loaded), or None where it died while starting."""
        a = self.Runner.options(scheduling_strategy="SPREAD").remote(self.plan)
        try:
            self.nodes.add(self.ray.get(a.where.remote())["node"])
            return a
        except self.died:
            return None

    def run(self, cells, progress=None) -> list[dict]:
        """-> the cells' records in their order; a cell whose actor died goes to the next free actor."""
        ray = self.ray
        queue, attempts, results, running = list(range(len(cells))), {}, {}, {}
        idle = list(self.actors)

        def submit(actor):
            i = queue.pop(0)
            attempts[i] = attempts.get(i, 0) + 1
            running[actor.run.remote(cells[i])] = (actor, i)
        while queue and idle:
            submit(idle.pop(0))
        while running:
            done, _ = ray.wait(list(running), num_returns=1)
            actor, i = running.pop(done[0])
            try:
                rec = ray.get(done[0])
            except self.died:
                if attempts[i] >= MAX_ATTEMPTS:
                    raise SweepError(f"cell {cells[i].label()}: its actor died {attempts[i]} times") from None
                queue.insert(0, i)
                self.rerun += 1
                self.actors.remove(actor)
                actor = self.new_actor()
                if actor is None:
                    if not running and not self.actors:
                        raise SweepError("the replacement actor died too and none is left") from None
                    actor = self.actors[0] if not running else None
                else:
                    self.actors.append(actor)
                if actor is not None and queue:
                    submit(actor)
                continue
            if "error" in rec:
                raise SweepError(f"cell {cells[i].label()}: {rec['error']}")
            if i not in results:                      # counted once
                results[i] = rec
                if progress:
                    progress(rec)
            if queue:
                submit(actor)
        self.where = (f"ray: {len(self.actors)} actors on {len(self.nodes)} node(s), {self.rerun} cell(s) rerun "
                      "after an actor died")
        return [results[i] for i in range(len(cells))]

    def close(self):
        if self.started_here:
            self.ray.shutdown()
