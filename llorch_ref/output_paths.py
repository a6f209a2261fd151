"""Where commands write: one place that checks an output path before any work is done, and writes through
a staging file or folder, so that nothing the command did not create is removed or overwritten.

Rules, for every file-writing command (convert, dump, prove, bench --json):
- an output is never an input, never holds an input, and never replaces a file inside an input folder;
- an existing output is replaced only with --overwrite, and only if it is the kind of thing the command
  writes: a regular file (or a symbolic link, which is replaced, never its target) for a file; a folder
  that holds nothing but the names the command writes, for a folder;
- FIFOs, devices and sockets are never written to or replaced; a path with a control character, or a name
  longer than the file system allows, is refused before any work;
- staging names come from `tempfile` (unique, in the output's folder), so a user's file is never taken for
  a leftover and removed; the staging file or folder is removed on any failure.
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .errors import OutputPathError

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_STAGING_SUFFIX = ".llorch-part"
_RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+:@=-]*")
RUN_ID_MAX = 100


def _name_max(folder: Path) -> int:
    try:
        return os.pathconf(folder, "PC_NAME_MAX")
    except (OSError, ValueError):
        return 255


def _nearest_existing(p: Path) -> Path:
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def _inside(child: Path, parent: Path) -> bool:
    return child == parent or parent in child.parents


def _mode(default: int) -> int:
    """default (0o666 files, 0o777 folders) less the process umask: what open() or mkdir() would give."""
    mask = os.umask(0)
    os.umask(mask)
    return default & ~mask


def check_run_id(run_id: str) -> str:
    """A run id becomes file names and headings: letters, digits and . _ + : @ = -, at most 100 characters."""
    if not isinstance(run_id, str) or not _RUN_ID.fullmatch(run_id) or len(run_id) > RUN_ID_MAX:
        raise OutputPathError(f"run id {run_id[:120]!r}{'...' if len(str(run_id)) > 120 else ''}: use 1-{RUN_ID_MAX} "
                              f"letters, digits or . _ + : @ = - (starting with a letter or digit)")
    return run_id


@dataclass(frozen=True)
class Output:
    """A checked output path; write through staged_file() or staged_folder()."""
    path: Path
    kind: str                   # "file" or "folder"
    overwrite: bool
    owned: frozenset            # folder: the names the command writes into it
    make_parents: bool = False  # missing parent folders are created when the output is written

    def _foreign(self) -> list[str]:
        """Entries of the existing folder that the command does not write (or that are not plain files)."""
        out = []
        for e in sorted(os.listdir(self.path)):
            st = os.lstat(self.path / e)
            if e not in self.owned or not stat.S_ISREG(st.st_mode):
                out.append(e)
        return out

    def _make_parents(self):
        if self.make_parents:
            with _os_errors(self.path.parent, "cannot make the folder"):
                self.path.parent.mkdir(parents=True, exist_ok=True)

    @contextlib.contextmanager
    def staged_file(self):
        """Yields a unique staging path beside the output; renamed onto the output when the block ends
        without an error, removed otherwise."""
        self._make_parents()
        with _os_errors(self.path.parent, "cannot write there"):
            fd, tmp = tempfile.mkstemp(**_staging(self.path))
        os.close(fd)
        tmp = Path(tmp)
        try:
            with _os_errors(self.path, "could not write it"):
                yield tmp
                os.chmod(tmp, _mode(0o666))
                _recheck(self)
                os.replace(tmp, self.path)
        finally:
            if os.path.lexists(tmp):
                os.unlink(tmp)

    @contextlib.contextmanager
    def staged_folder(self):
        """Yields a unique staging folder beside the output; it replaces the output when the block ends
        without an error (an existing output folder loses only the names the command writes), and is
        removed otherwise."""
        self._make_parents()
        with _os_errors(self.path.parent, "cannot write there"):
            tmp = Path(tempfile.mkdtemp(**_staging(self.path)))
        try:
            with _os_errors(self.path, "could not write it"):
                yield tmp
                os.chmod(tmp, _mode(0o777))
                for f in tmp.iterdir():               # some writers (safetensors) create files 0600
                    if f.is_file() and not f.is_symlink():
                        os.chmod(f, _mode(0o666))
                _recheck(self)
                if os.path.lexists(self.path):
                    for name in self.owned:
                        if os.path.lexists(self.path / name):
                            os.unlink(self.path / name)
                    os.rmdir(self.path)
                os.rename(tmp, self.path)
        finally:
            if os.path.lexists(tmp):
                shutil.rmtree(tmp)


@contextlib.contextmanager
def _os_errors(where, doing: str):
    """An OSError inside becomes one OutputPathError line: '<where>: <doing> (<reason>)'."""
    try:
        yield
    except OSError as e:
        raise OutputPathError(f"{where}: {doing} ({e.strerror or e})") from None


def _staging(path: Path) -> dict:
    """tempfile arguments for a unique staging name beside path."""
    return {"prefix": f".{path.name[:40]}.", "suffix": _STAGING_SUFFIX, "dir": path.parent}


def _recheck(out: Output):
    """Just before the rename: the output must still be what check_output accepted (nothing appeared, a
    folder gained no foreign file while the command ran)."""
    if not os.path.lexists(out.path):
        return
    if not out.overwrite:
        raise OutputPathError(f"{out.path}: appeared while the command ran; not replaced (pass --overwrite)")
    if out.kind == "folder":
        foreign = out._foreign()
        if foreign:
            raise OutputPathError(f"{out.path}: now holds {', '.join(foreign[:5])}, which this command does not "
                                  f"write; not replaced")


def check_output(path, *, kind: str = "file", inputs=(), overwrite: bool = False, owned=(), what: str = "output",
                 make_parents: bool = False) -> Output:
    """Check an output path before any work; -> Output. Raises OutputPathError with a one-line reason.

    inputs: files or folders the command reads (the output may not be, hold, or lie in an existing part of
    any of them); owned: for a folder, the names the command writes (an existing folder holding anything
    else is never replaced); make_parents: missing parent folders are created (prove --out)."""
    if kind not in ("file", "folder"):
        raise ValueError(kind)
    p = Path(os.path.abspath(os.fspath(path)))
    if _CONTROL.search(str(path)):
        raise OutputPathError(f"{what} {str(path)!r}: the path holds a control character (newline, tab, ...)")
    if p.name in ("", ".", ".."):
        raise OutputPathError(f"{what} {path}: give a file or folder name")
    base = _nearest_existing(p.parent)
    if not base.is_dir():
        raise OutputPathError(f"{what} {path}: {base} is not a folder")
    if p.parent != base and not make_parents:
        raise OutputPathError(f"{what} {path}: no such folder {p.parent}")
    limit = _name_max(base)
    if len(os.fsencode(p.name)) > limit:
        raise OutputPathError(f"{what} {str(path)[:60]}...: the name is "
                              f"{len(os.fsencode(p.name))} bytes; this file system allows {limit}")
    real = p.resolve()
    for i in inputs:
        ir = Path(i).resolve()
        if real == ir:
            raise OutputPathError(f"{what} {path} is the input {i}; write somewhere else")
        if _inside(ir, real):
            raise OutputPathError(f"{what} {path} holds the input {i}; write somewhere else")
        if ir.is_dir() and _inside(real, ir) and os.path.lexists(p):
            raise OutputPathError(f"{what} {path} is part of the input folder {i}; it is never replaced")
    out = Output(p, kind, overwrite, frozenset(owned), make_parents)
    if os.path.lexists(p):
        _check_existing(out, path, what)
    _probe(base, path, what)
    return out


def _check_existing(out: Output, shown, what):
    st = os.lstat(out.path)
    if not out.overwrite:
        raise OutputPathError(f"{what} {shown} already exists (pass --overwrite to replace it)")
    if stat.S_ISLNK(st.st_mode):
        if out.kind == "folder":
            raise OutputPathError(f"{what} {shown} is a symbolic link; give the folder itself")
        return                                       # a link is replaced by the file; its target is untouched
    if out.kind == "file":
        if stat.S_ISDIR(st.st_mode):
            raise OutputPathError(f"{what} {shown} is a folder; give a file path")
        if not stat.S_ISREG(st.st_mode):
            raise OutputPathError(f"{what} {shown} is not a regular file (a FIFO, device or socket); not replaced")
        return
    if not stat.S_ISDIR(st.st_mode):
        raise OutputPathError(f"{what} {shown} exists and is not a folder; not replaced")
    foreign = out._foreign()
    if foreign:
        more = f" and {len(foreign) - 5} more" if len(foreign) > 5 else ""
        raise OutputPathError(f"{what} {shown} holds {', '.join(foreign[:5])}{more}, which this command does not "
                              f"write; it is never replaced: choose a new or empty folder")


def _probe(base: Path, shown, what):
    """Create and remove a staging file where the output goes: a read-only or pseudo file system (/proc)
    is named now, before the work, not after it."""
    with _os_errors(f"{what} {shown}", f"cannot write in {base}"):
        fd, tmp = tempfile.mkstemp(prefix=".llorch-probe.", suffix=_STAGING_SUFFIX, dir=base)
    os.close(fd)
    os.unlink(tmp)


def check_container(path, *, what: str = "--out") -> Path:
    """A folder that outputs are written into (prove's bundle folder): created with its parents if missing;
    if it exists it must be a folder (or a link to one). Nothing in it is replaced."""
    p = Path(os.path.abspath(os.fspath(path)))
    if _CONTROL.search(str(path)):
        raise OutputPathError(f"{what} {str(path)!r}: the path holds a control character (newline, tab, ...)")
    long = [part for part in p.parts if len(os.fsencode(part)) > 255]
    if long:
        raise OutputPathError(f"{what} {str(path)[:60]}...: a name is {len(os.fsencode(long[0]))} bytes; file "
                              f"systems allow 255")
    if p.exists() and not p.is_dir():
        raise OutputPathError(f"{what} {path} exists and is not a folder")
    base = _nearest_existing(p)
    if not base.is_dir():
        raise OutputPathError(f"{what} {path}: {base} is not a folder")
    _probe(base, path, what)
    return p
