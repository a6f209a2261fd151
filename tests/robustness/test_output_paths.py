"""A fuzz over output paths for every file-writing command (convert in its three directions, dump, prove):
existing files, folders holding the input, the input itself, symbolic links, FIFOs and devices, long and odd
names, places that cannot be written. Whatever the command, target and --overwrite:

- the input is never changed; without --overwrite nothing that existed is changed or removed; with it,
  only the target itself (a link is replaced, never its target; a folder holding anything the command does
  not write is never replaced);
- no staging file or folder is left anywhere;
- the command succeeds or prints exactly one `error:` line (no traceback).

(serve writes no files.) Commands run in-process through llorch_ref.cli.main, so the fuzz stays fast."""
from __future__ import annotations

import hashlib
import os
import shutil
import stat
from pathlib import Path

import pytest

from llorch_ref import cli

TARGETS = ["in.gguf", "link_to_in", "precious.txt", "link_to_precious", "fifo", "dir_with_input",
           "dir_with_input/in.gguf", "hfdir", "hfdir/model.safetensors", "empty_dir", "new.out",
           "new dir/\u00fc n\u00e4me.out", "bad\nname.out", "x" * 300, "missing/sub/out", "/proc/llorch-x/out",
           "/dev/null", "new.out.part", "link_to_dir"]
INPUT = {"gguf": "in.gguf", "to-hf": "in.gguf", "from-hf": "hfdir", "dump": "in.gguf", "prove": "in.gguf"}
HF_NAMES = {"model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"}


def expected(kind, target, overwrite) -> int:
    """The issue's rules, written from the outside: 0 (written) or 2 (refused with one line)."""
    folder_out = kind == "to-hf"
    p, inp = Path(target), Path(INPUT[kind])
    if any(ord(c) < 32 for c in target) or len(p.name.encode()) > 255 or target.startswith(("/proc", "/dev")):
        return 2
    if target in ("fifo",) or p.resolve() == inp.resolve() or inp.resolve().is_relative_to(p.resolve()):
        return 2
    if p.resolve().is_relative_to(inp.resolve()) and os.path.lexists(p):
        return 2
    if not os.path.lexists(p):
        return 0 if (p.parent.is_dir() or folder_out) else 2
    if not overwrite:
        return 2
    if folder_out:
        ok = p.is_dir() and not p.is_symlink() and all(
            n in HF_NAMES and (p / n).is_file() for n in os.listdir(p))
        return 0 if ok else 2
    return 2 if (p.is_dir() and not p.is_symlink()) else 0


def snapshot(root: Path) -> dict:
    """path (relative) -> what it is: ('file', sha256) | ('link', target) | ('dir',) | ('fifo',)."""
    out = {}
    for d, dirs, files in os.walk(root):
        for n in dirs + files:
            p = Path(d) / n
            rel = str(p.relative_to(root))
            st = os.lstat(p)
            if stat.S_ISLNK(st.st_mode):
                out[rel] = ("link", os.readlink(p))
            elif stat.S_ISDIR(st.st_mode):
                out[rel] = ("dir",)
            elif stat.S_ISFIFO(st.st_mode):
                out[rel] = ("fifo",)
            else:
                out[rel] = ("file", hashlib.sha256(p.read_bytes()).hexdigest())
    return out


@pytest.fixture(scope="module")
def template(tiny, tmp_path_factory):
    from llorch_ref.convert import convert_gguf_to_hf

    t = tmp_path_factory.mktemp("sandbox-template")
    shutil.copy(tiny(vocab="bpe"), t / "in.gguf")
    (t / "precious.txt").write_text("keep me\n")
    convert_gguf_to_hf(t / "in.gguf", t / "hfdir")
    (t / "dir_with_input").mkdir()
    shutil.copy(t / "in.gguf", t / "dir_with_input" / "in.gguf")
    (t / "dir_with_input" / "notes.txt").write_text("mine\n")
    (t / "empty_dir").mkdir()
    (t / "new.out.part").write_text("a user's file that looks like a leftover\n")
    return t


def build(template: Path, box: Path) -> Path:
    """A fresh sandbox from the template (links and the FIFO made here: copytree would read a FIFO)."""
    if box.exists():
        shutil.rmtree(box)
    shutil.copytree(template, box, symlinks=True)
    os.symlink("in.gguf", box / "link_to_in")
    os.symlink("precious.txt", box / "link_to_precious")
    os.symlink("empty_dir", box / "link_to_dir")
    os.mkfifo(box / "fifo")
    os.chdir(box)
    return box


@pytest.fixture()
def sandbox(template, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)                     # restored after the test
    return build(template, tmp_path / "box")


def command(kind, target, overwrite):
    ow = ["--overwrite"] if overwrite else []
    return {"gguf": ["convert", *ow, "in.gguf", target],
            "to-hf": ["convert", "--to", "hf", *ow, "in.gguf", target],
            "from-hf": ["convert", *ow, "hfdir", target],
            "dump": ["dump", "--engine", "llorch", "--model", "in.gguf", "--token-ids", "1,2,3", "--greedy", "2",
                     "--out", target, *ow],
            "prove": ["prove", "--model", "in.gguf", "--checkpoint", "1", "--greedy", "2", "--run-id", "fuzz",
                      "--out", target]}[kind]


def check_run(box, kind, target, overwrite, capsys):
    before = snapshot(box)
    rc = cli.main(command(kind, target, overwrite))
    err = capsys.readouterr().err
    after = snapshot(box)
    errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert "Traceback" not in err
    assert rc in (0, 1) or (rc == 2 and len(errors) == 1), (rc, err)
    t = os.path.normpath(target) if not target.startswith("/") else None
    may_change = {t} if overwrite and t else set()
    if kind == "prove" and t:                       # prove adds bundles inside its folder, replaces nothing
        may_change = set()
    for rel, what in before.items():
        if rel in may_change or any(rel.startswith(m + "/") for m in may_change):
            continue
        assert after.get(rel) == what, f"{kind} {target!r} overwrite={overwrite}: {rel} changed: {what} -> {after.get(rel)}"
    for inp in (INPUT[kind],):                      # the input: never, with or without --overwrite
        for rel, what in before.items():
            if rel == inp or rel.startswith(inp + "/"):
                assert after.get(rel) == what, f"{kind} {target!r}: the input {rel} changed"
    if before.get("dir_with_input/notes.txt"):
        assert after.get("dir_with_input/notes.txt") == before["dir_with_input/notes.txt"]
    new = set(after) - set(before)
    leftovers = [n for n in after if n.endswith(".llorch-part") or os.path.basename(n).startswith((".incomplete", ".llorch-probe"))]
    assert not leftovers, leftovers
    for n in new:                                   # new entries: the target, below it, or folders above it
        assert t is not None and (n == t or n.startswith(t + "/") or t.startswith(n + "/") or kind == "prove"), n
    return rc, errors


@pytest.mark.parametrize("overwrite", [False, True])
@pytest.mark.parametrize("kind", ["gguf", "to-hf", "from-hf", "dump"])
def test_output_path_fuzz(template, sandbox, kind, overwrite, capsys):
    wrong = []
    for target in TARGETS:
        want = expected(kind, target, overwrite)
        got = check_run(sandbox, kind, target, overwrite, capsys)[0]
        if got != want:
            wrong.append((target, got, want))
        build(template, sandbox)                    # a successful write changed the sandbox
    assert not wrong, wrong


@pytest.mark.llamacpp
@pytest.mark.parametrize("target", ["precious.txt", "fifo", "link_to_precious", "dir_with_input", "new dir",
                                    "/proc/llorch-x", "bad\nname", "x" * 300])
def test_prove_output_fuzz(sandbox, llamacpp, target, capsys):
    rc, errors = check_run(sandbox, "prove", target, False, capsys)
    if target in ("dir_with_input", "new dir"):
        assert rc in (0, 1)                         # bundles written beside what is there; nothing replaced
    else:
        assert rc == 2


def test_a_users_part_file_is_never_taken_for_a_leftover(sandbox, capsys):
    before = (sandbox / "new.out.part").read_text()
    assert cli.main(["convert", "in.gguf", "new.out"]) == 0
    assert (sandbox / "new.out.part").read_text() == before
