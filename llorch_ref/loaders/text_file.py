"""Text files a user names by an option (--prompt-file, --text, --api-token-file, the pytest plugin's
--llorch-prompt-file): the path checked before a byte is read (it exists and is a regular file, or a link to
one: a FIFO would block the read, a device never end it) and no larger than a limit, then read whole as
UTF-8. Every failure is a ParameterError naming the option and the file.

    checked_path(path, option, limit=TEXT_LIMIT) -> Path
    read_text_file(path, option, limit=TEXT_LIMIT, blank_ok=False) -> str
"""
from __future__ import annotations

import stat
from pathlib import Path

from ..errors import ParameterError

TEXT_LIMIT = 64 << 20      # bytes: the largest text file an option takes


def checked_path(path, option: str, limit: int = TEXT_LIMIT) -> Path:
    """path, given by `option`: it exists, is a regular file (or a link to one) and holds at most limit bytes."""
    p = Path(path)
    try:
        st = p.stat()
    except FileNotFoundError:
        raise ParameterError(f"{option} {p}: no such file") from None
    except OSError as e:
        raise ParameterError(f"{option} {p}: cannot read it ({e.strerror or e})") from None
    if stat.S_ISDIR(st.st_mode):
        raise ParameterError(f"{option} {p}: is a folder, not a text file")
    if not stat.S_ISREG(st.st_mode):
        raise ParameterError(f"{option} {p}: not a regular file (a FIFO, device or socket)")
    if st.st_size > limit:
        raise ParameterError(f"{option} {p}: {st.st_size} bytes, over the limit of {_size(limit)}: give a "
                             f"shorter file")
    return p


def read_text_file(path, option: str, limit: int = TEXT_LIMIT, blank_ok: bool = False) -> str:
    """The text of the UTF-8 file `option` names (checked_path's checks; at most limit bytes even if it grows
    while read); blank text is an error unless blank_ok."""
    p = checked_path(path, option, limit)
    try:
        with open(p, "rb") as f:
            data = f.read(limit + 1)
    except OSError as e:
        raise ParameterError(f"{option} {p}: cannot read it ({e.strerror or e})") from None
    if len(data) > limit:
        raise ParameterError(f"{option} {p}: more than {_size(limit)}: give a shorter file")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ParameterError(f"{option} {p}: cannot read it as UTF-8 text (byte {e.start}: {e.reason})") from None
    if not blank_ok and not text.strip():
        raise ParameterError(f"{option} {p}: the file holds no text")
    return text


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n} bytes"
