"""Paths in what a bundle keeps, made portable: a path under $LLORCH_HOME, the current folder or the home
folder is written `$LLORCH_HOME/...`, relative, or `~/...`; `expand_path` turns one back into this machine's."""
from __future__ import annotations

import os
import re
from pathlib import Path

from ..loaders.default_model import home as llorch_home


def portable(x):
    """Machine paths made portable, recursively: $LLORCH_HOME/..., ~/... and paths under the current folder
    relative to it (expand_path undoes it)."""
    if isinstance(x, dict):
        return {k: portable(v) for k, v in x.items()}
    if isinstance(x, list):
        return [portable(v) for v in x]
    if not isinstance(x, str) or "/" not in x:
        return x
    for root, name in ((str(llorch_home()), "$LLORCH_HOME"), (os.getcwd(), "."), (str(Path.home()), "~")):
        root = root.rstrip("/")
        if root:
            x = re.sub(r"(^|[\s=:\"'(])" + re.escape(root) + r"(?=/|$|\s)", lambda m, name=name: m[1] + name, x)
    return x


def expand_path(p: str) -> Path:
    """A path as the manifest keeps it (portable) -> this machine's path."""
    if p.startswith("$LLORCH_HOME"):
        return llorch_home() / p[len("$LLORCH_HOME/"):]
    return Path(os.path.expanduser(p))
