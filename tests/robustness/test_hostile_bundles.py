"""Hostile proof bundles: a recipe naming a device, token counts past the context or too big for memory, a
subject.npz that inflates far past the bundle's shapes, an object array or a file that is not a zip, manifests
and result.json nested too deep, missing keys or of the wrong type, and a $GITHUB_STEP_SUMMARY that is a folder
each end in one line `error: ...` and exit 2 within seconds; a few hundred mutated manifests, pages and tensor
files never trace back, never hang and never verify as OK."""
from __future__ import annotations

import contextlib
import io
import json
import random
import shutil
import signal
import struct
import tracemalloc
import zipfile
from pathlib import Path

import numpy as np
import pytest

import llorch_ref
from llorch_ref.cli import main

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def model(tiny):
    return tiny(vocab="bpe", n_layers=1, context_length=4096)


@pytest.fixture(scope="module")
def bundle(model, tmp_path_factory) -> Path:
    """A PASS bundle with its tensors, from a one-layer model whose context holds 4096 tokens."""
    from llorch_ref.checkpoints import engine_band_class
    from llorch_ref.harness.bundle import write_bundle
    from llorch_ref.harness.run import run_subject
    from llorch_ref.references.llorch import record_engine

    eng = llorch_ref.load(model)
    ids = eng.tokenizer.encode(PROMPT)
    sub = record_engine(llorch_ref.load(model), ids, prompt=PROMPT, n_greedy=2).to_dump()
    res = run_subject(eng, sub, engine_band_class(eng), subject_label="hostile engine")
    return write_bundle(res, eng, out_dir=tmp_path_factory.mktemp("hostile"), run_id="clean", plot=False,
                        argv=["llorch-ref", "prove", "--no-plots"])["dir"]


@contextlib.contextmanager
def deadline(seconds: int):
    """Raise TimeoutError in the test when the block runs past seconds (a hang fails, never blocks the suite)."""
    def fire(*_):
        raise TimeoutError(f"ran past {seconds} s")
    old = signal.signal(signal.SIGALRM, fire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def verify(run, *more, capsys, seconds: int = 20) -> tuple[int, str, str]:
    with deadline(seconds):
        rc = main(["verify", str(run), *more])
    got = capsys.readouterr()
    return rc, got.out, got.err


def one_error(rc: int, err: str) -> str:
    """The single `error:` line of an exit-2 refusal."""
    lines = err.strip().splitlines()
    errors = [ln for ln in lines if ln.startswith("error: ")]
    assert rc == 2 and len(errors) == 1 and "Traceback" not in err, (rc, err)
    return errors[0]


def copy(bundle: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "run"
    shutil.copytree(bundle, dst)
    return dst


def rehash(run: Path):
    """Every regular file's sha256 written into the manifest again (what a forger does after an edit)."""
    from llorch_ref.harness.bundle import sha256_of

    man = json.loads((run / "manifest.json").read_text())
    man["files"] = {p.relative_to(run).as_posix(): sha256_of(p) for p in sorted(run.rglob("*"))
                    if p.is_file() and p.name != "manifest.json"}
    (run / "manifest.json").write_text(json.dumps(man, indent=2))


def edit_manifest(run: Path, change):
    p = run / "manifest.json"
    man = json.loads(p.read_text())
    change(man)
    p.write_text(json.dumps(man, indent=2))


# -- the model file the recipe names --------------------------------------------------------------------------
def test_a_recipe_naming_dev_zero_is_refused_at_once(bundle, tmp_path, capsys):
    run = copy(bundle, tmp_path)
    edit_manifest(run, lambda m: m["recipe"].update(model="/dev/zero"))
    rc, out, err = verify(run, capsys=capsys, seconds=10)
    line = one_error(rc, err)
    assert "/dev/zero" in line and "regular file" in line, line


def test_a_recipe_naming_a_fifo_is_refused_at_once(bundle, tmp_path, capsys):
    import os

    run = copy(bundle, tmp_path)
    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    edit_manifest(run, lambda m: m["recipe"].update(model=str(fifo)))
    rc, out, err = verify(run, capsys=capsys, seconds=10)
    assert "regular file" in one_error(rc, err)


def test_the_model_hash_reads_no_more_than_the_file_size(tmp_path):
    from llorch_ref.harness.verify import model_file_sha256

    p = tmp_path / "m.gguf"
    p.write_bytes(b"GGUF" + bytes(1000))
    import hashlib
    assert model_file_sha256(p) == hashlib.sha256(p.read_bytes()).hexdigest()


# -- token counts and memory ----------------------------------------------------------------------------------
def test_token_ids_past_the_models_context_are_refused(bundle, tmp_path, capsys):
    run = copy(bundle, tmp_path)
    edit_manifest(run, lambda m: m["recipe"].update(token_ids=[1] * 5000))
    rc, out, err = verify(run, capsys=capsys, seconds=15)
    line = one_error(rc, err)
    assert "5000" in line and "context" in line and "4096" in line, line


def test_a_rerun_too_big_for_memory_is_refused_with_its_estimate(bundle, tmp_path, capsys, monkeypatch):
    run = copy(bundle, tmp_path)
    edit_manifest(run, lambda m: m["recipe"].update(token_ids=[1] * 3000))
    monkeypatch.setattr("llorch_ref.harness.verify.mem_available", lambda: 64 << 20, raising=False)
    rc, out, err = verify(run, capsys=capsys, seconds=15)
    line = one_error(rc, err)
    assert "GiB" in line and "3000 tokens" in line and "80%" in line, line


# -- tensor files ---------------------------------------------------------------------------------------------
def npy_bytes(a: np.ndarray) -> bytes:
    b = io.BytesIO()
    np.lib.format.write_array(b, a, allow_pickle=True)
    return b.getvalue()


def test_a_subject_npz_that_inflates_past_the_bundles_shapes_is_refused_unread(bundle, tmp_path, capsys):
    """64 MiB of zeros (64 KiB compressed) as cp7.l_out.layer0, whose shape is 4 x 64 floats here."""
    run = copy(bundle, tmp_path)
    p = run / "cp7_block" / "subject.npz"
    with zipfile.ZipFile(p, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("cp7.l_out.layer0.npy", npy_bytes(np.zeros(16 << 20, np.float32)))
    assert p.stat().st_size < 1 << 20
    rehash(run)
    tracemalloc.start()
    try:
        rc, out, err = verify(run, capsys=capsys, seconds=15)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    line = one_error(rc, err)
    assert "cp7_block/subject.npz" in line and "cp7.l_out.layer0" in line, line
    assert peak < 16 << 20, f"{peak / 2**20:.0f} MiB traced while refusing it"


def test_a_member_declaring_three_gib_is_refused_unread(bundle, tmp_path, capsys):
    """A member whose zip header declares 3 GiB (the bytes behind it are small): refused by the declaration."""
    run = copy(bundle, tmp_path)
    p = run / "cp7_block" / "subject.npz"
    with zipfile.ZipFile(p, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("cp7.l_out.layer0.npy", npy_bytes(np.zeros(1024, np.float32)))
    data = bytearray(p.read_bytes())
    for sig, at in ((b"PK\x03\x04", 22), (b"PK\x01\x02", 24)):       # uncompressed size: local and central header
        i = data.index(sig)
        data[i + at:i + at + 4] = struct.pack("<I", 3 << 30)
    p.write_bytes(bytes(data))
    rehash(run)
    rc, out, err = verify(run, capsys=capsys, seconds=15)
    line = one_error(rc, err)
    assert "cp7.l_out.layer0" in line and "GiB" in line, line


def test_an_npy_header_past_the_bound_is_refused_unread(bundle, tmp_path, capsys):
    run = copy(bundle, tmp_path)
    p = run / "cp7_block" / "subject.npz"
    head = io.BytesIO()
    np.lib.format.write_array_header_1_0(head, {"descr": "<f4", "fortran_order": False, "shape": (1 << 30,)})
    with zipfile.ZipFile(p, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("cp7.l_out.layer0.npy", head.getvalue() + bytes(64))
    rehash(run)
    rc, out, err = verify(run, capsys=capsys, seconds=15)
    line = one_error(rc, err)
    assert "cp7.l_out.layer0" in line, line


def test_a_subject_npz_that_is_not_a_zip_is_refused(bundle, tmp_path, capsys):
    run = copy(bundle, tmp_path)
    (run / "cp7_block" / "subject.npz").write_bytes(b"not a zip file at all\n" * 10)
    rehash(run)
    rc, out, err = verify(run, capsys=capsys)
    assert "cp7_block/subject.npz" in one_error(rc, err)


def test_an_object_array_is_refused(bundle, tmp_path, capsys):
    run = copy(bundle, tmp_path)
    p = run / "cp7_block" / "subject.npz"
    with zipfile.ZipFile(p, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("cp7.l_out.layer0.npy", npy_bytes(np.array([{"a": 1}, None], dtype=object)))
    rehash(run)
    rc, out, err = verify(run, capsys=capsys)
    line = one_error(rc, err)
    assert "object" in line and "cp7.l_out.layer0" in line, line


# -- manifest.json and result.json ----------------------------------------------------------------------------
def deep(n: int) -> str:
    return "[" * n + "]" * n


@pytest.mark.parametrize("case", ["deep manifest", "no checkpoints", "recipe a string", "no model_sha256",
                                  "files a list", "token id a string", "deep inside the recipe",
                                  "gpu layers a string", "no batch"])
def test_a_malformed_manifest_is_one_error_line(bundle, tmp_path, capsys, case):
    run = copy(bundle, tmp_path)
    p = run / "manifest.json"
    man = json.loads(p.read_text())
    if case == "deep manifest":
        p.write_text(p.read_text()[:-2] + ', "x": ' + deep(100_000) + "}\n")
    else:
        {"no checkpoints": lambda: man.pop("checkpoints"), "recipe a string": lambda: man.update(recipe="x"),
         "no model_sha256": lambda: man["recipe"].pop("model_sha256"),
         "files a list": lambda: man.update(files=list(man["files"])),
         "token id a string": lambda: man["recipe"]["token_ids"].__setitem__(0, "1"),
         "deep inside the recipe": lambda: man["recipe"].update(rows=json.loads(deep(900))),
         "gpu layers a string": lambda: man["recipe"].update(n_gpu_layers="all"),
         "no batch": lambda: man["recipe"].update(n_batch=0)}[case]()
        p.write_text(json.dumps(man))
    rc, out, err = verify(run, capsys=capsys)
    assert "manifest.json" in one_error(rc, err)


@pytest.mark.parametrize("text", ["not json {", deep(100_000), '{"rows": [' + "1" * 5000 + "]}",
                                  '{"rows": "x"}', "[]", '{"rows": [{"checkpoint": []}]}'])
def test_a_malformed_result_json_is_one_error_line(bundle, tmp_path, capsys, text):
    run = copy(bundle, tmp_path)
    (run / "result.json").write_text(text)
    rehash(run)
    rc, out, err = verify(run, capsys=capsys)
    assert "result.json" in one_error(rc, err)


# -- prove ----------------------------------------------------------------------------------------------------
def test_a_step_summary_that_is_a_folder_is_refused_before_the_run(model, tmp_path, capsys, monkeypatch):
    folder = tmp_path / "summary-folder"
    folder.mkdir()
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(folder))
    monkeypatch.setattr("llorch_ref.cli.comparisons.run_comparison",
                        lambda args: pytest.fail("the comparison ran ahead of the summary path check"))
    rc = main(["prove", "--model", str(model), "--out", str(tmp_path / "pb"), "--run-id", "r", "--no-plots"])
    line = one_error(rc, capsys.readouterr().err)
    assert "GITHUB_STEP_SUMMARY" in line and "folder" in line, line
    assert not (tmp_path / "pb" / "r").exists()


def test_a_run_id_taken_while_prove_runs_names_what_to_do(model, tmp_path, capsys, monkeypatch):
    from llorch_ref.harness import bundle as bundle_mod

    real = bundle_mod.junit.xml

    def taken(result, run_id):
        (tmp_path / "pb" / run_id).mkdir(parents=True)        # another prove of the same --run-id finished
        return real(result, run_id)
    monkeypatch.setattr(bundle_mod.junit, "xml", taken)
    rc = main(["prove", "--model", str(model), "--out", str(tmp_path / "pb"), "--run-id", "r", "--no-plots",
               "--greedy", "2"])
    line = one_error(rc, capsys.readouterr().err)
    assert "--overwrite" not in line and "--run-id" in line and "remove" in line, line
    assert [p.name for p in (tmp_path / "pb").iterdir()] == ["r"] and not list((tmp_path / "pb" / "r").iterdir())


# -- fuzz -----------------------------------------------------------------------------------------------------
def _paths(doc, at=()):
    """Every (path, value) inside a JSON document."""
    yield at, doc
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from _paths(v, at + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from _paths(v, at + (i,))


def _mutate_json(doc, rng: random.Random):
    """One edit at a random place: a field deleted, retyped, a number changed, a string made a list."""
    places = [p for p, _ in _paths(doc) if p]
    path = rng.choice(places)
    parent = doc
    for k in path[:-1]:
        parent = parent[k]
    key, value = path[-1], parent[path[-1]]
    how = rng.choice(["delete", "none", "retype", "number", "list", "deep", "huge"])
    if how == "delete":
        del parent[key]
    elif how == "none":
        parent[key] = None
    elif how == "retype":
        parent[key] = {str: 7, int: "7", float: "0.5", bool: "true", list: {"a": 1}, dict: [1, 2]}.get(type(value), 3)
    elif how == "number":
        parent[key] = rng.choice([-1, 0, 2 ** 63, 1e308, -1e-308, 0.5, 10 ** 6]) if not isinstance(value, (int, float)) \
            or isinstance(value, bool) else value * rng.choice([-1, 2, 1e6, 0]) + rng.choice([0, 1])
    elif how == "list":
        parent[key] = [value, value]
    elif how == "deep":
        parent[key] = json.loads(deep(rng.choice([50, 500])))
    else:
        parent[key] = "x" * 100_000
    return f"{how} at {'/'.join(map(str, path))}"


def _mutate_bytes(data: bytes, rng: random.Random) -> tuple[bytes, str]:
    how = rng.choice(["truncate", "junk", "flip", "empty"])
    if how == "truncate":
        n = rng.randrange(len(data))
        return data[:n], f"truncated at {n}"
    if how == "junk":
        n = rng.randrange(len(data) + 1)
        return data[:n] + bytes(rng.randrange(256) for _ in range(64)) + data[n:], f"64 junk bytes at {n}"
    if how == "flip":
        b = bytearray(data)
        for _ in range(8):
            i = rng.randrange(len(b))
            b[i] ^= 1 << rng.randrange(8)
        return bytes(b), "8 bits flipped"
    return b"", "emptied"


PAGES = ["result.json", "summary.md", "junit.xml", "report.html", "cp7_block/report.json", "cp4_attention_scores/report.md",
         "cp12_greedy_text/report.json"]


def _check(rc, err, what, allow_ok) -> str | None:
    """None when the outcome is allowed; else what went wrong."""
    if rc == 2 and not (len(err.strip().splitlines()) >= 1 and err.strip().splitlines()[-1].startswith("error: ")):
        return f"{what}: exit 2 without an error line: {err[-300:]}"
    if rc not in (1, 2) and not (allow_ok and rc == 0):
        return f"{what}: exit {rc}"
    return None


@pytest.mark.parametrize("n", [100, pytest.param(300, marks=pytest.mark.slow)])
def test_fuzz_mutated_manifests_and_pages_never_trace_back_or_verify(bundle, tmp_path, capsys, n):
    run = copy(bundle, tmp_path)
    rng = random.Random(53)
    bad = []
    for i in range(n):
        name = "manifest.json" if i % 3 == 0 else rng.choice(PAGES)
        p = run / name
        original = p.read_bytes()
        if name.endswith(".json") and rng.random() < 0.7:
            doc = json.loads(original)
            what = _mutate_json(doc, rng)
            p.write_text(json.dumps(doc))
        else:
            data, what = _mutate_bytes(original, rng)
            p.write_bytes(data)
        what = f"#{i} {name}: {what}"
        more = [] if name == "manifest.json" or i % 4 == 1 else ["--no-rerun"]     # the re-run reads the recipe
        try:
            rc, out, err = verify(run, *more, capsys=capsys, seconds=20)
        except Exception as e:                        # a traceback the CLI would print
            bad.append(f"{what}: {type(e).__name__}: {str(e)[:200]}")
        else:
            found = _check(rc, err, what, allow_ok=name == "manifest.json")
            if found:
                bad.append(found)
        p.write_bytes(original)
    assert not bad, f"{len(bad)} of {n} mutations:\n" + "\n".join(bad[:30])


def _mutate_npz(p: Path, rng: random.Random) -> str:
    """A tensor file edited: its bytes, or its arrays re-zipped (scaled, NaN, reshaped, retyped, one dropped,
    one added, an object array)."""
    if rng.random() < 0.4:
        data, what = _mutate_bytes(p.read_bytes(), rng)
        p.write_bytes(data)
        return what
    with np.load(p) as z:
        arrays = {k: z[k] for k in z.files}
    k = rng.choice(sorted(arrays))
    a = arrays[k]
    how = rng.choice(["scale", "nan", "reshape", "float64", "drop", "add", "object", "int"])
    if how == "scale":
        arrays[k] = a * 2 + 1
    elif how == "nan":
        arrays[k] = np.full_like(a, np.nan, dtype=np.float32)
    elif how == "reshape":
        arrays[k] = a.reshape(-1)[:-1] if a.size > 1 else np.zeros((3, 3), np.float32)
    elif how == "float64":
        arrays[k] = a.astype(np.float64) + 1
    elif how == "drop":
        del arrays[k]
    elif how == "add":
        arrays[k + "x"] = a
        arrays[k] = a + 1
    elif how == "object":
        arrays[k] = np.array([None, 1], dtype=object)
    else:
        arrays[k] = (a * 1000).astype(np.int64) + 1
    with zipfile.ZipFile(p, "w", zipfile.ZIP_DEFLATED) as z:
        for name, arr in arrays.items():
            z.writestr(name + ".npy", npy_bytes(arr))
    return f"{how} {k}"


def test_fuzz_mutated_tensor_files_never_verify(bundle, tmp_path, capsys):
    run = copy(bundle, tmp_path)
    rng = random.Random(530)
    files = sorted(str(p.relative_to(run)) for p in run.rglob("*.npz"))
    bad = []
    for i in range(40):
        name = rng.choice(files)
        p = run / name
        original, manifest = p.read_bytes(), (run / "manifest.json").read_bytes()
        what = f"#{i} {name}: {_mutate_npz(p, rng)}"
        forged = i % 2 == 0
        if forged:
            rehash(run)
        try:
            rc, out, err = verify(run, capsys=capsys, seconds=20)
        except Exception as e:
            bad.append(f"{what}: {type(e).__name__}: {str(e)[:200]}")
        else:
            found = _check(rc, err, what + (" (rehashed)" if forged else ""), allow_ok=False)
            if found:
                bad.append(found)
        p.write_bytes(original)
        (run / "manifest.json").write_bytes(manifest)
    assert not bad, f"{len(bad)} of 40 mutations:\n" + "\n".join(bad[:30])
