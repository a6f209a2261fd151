"""A tool's Markdown result: its lines printed, and written to --out where one is given."""
from __future__ import annotations

from pathlib import Path


def emit(lines: list[str], out: str | None) -> str:
    """The lines as one text (ending in a newline): printed, and written to `out` unless it is None."""
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if out:
        Path(out).write_text(text)
    return text
