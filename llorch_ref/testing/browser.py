"""A report opened in a real browser: headless Chromium (Debian package `chromium`) loads the page from disk,
and what it printed to its console comes back with the rendered DOM (and a screenshot on request)."""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

CONSOLE = re.compile(r":CONSOLE(?:\(\d+\))?:?\d*\]\s*(.*)")


def chromium() -> str | None:
    """The Chromium binary on PATH, or None."""
    return next((p for p in (shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome")) if p), None)


def render(page, screenshot=None, size=(1280, 1400), timeout=120) -> dict:
    """-> {"dom": the DOM after load, "console": [what the page printed to its console]}; screenshot: a PNG
    path to write the first screen (size: the window in pixels)."""
    exe = chromium()
    if exe is None:
        raise FileNotFoundError("no chromium on PATH (Debian: apt-get install chromium)")
    url = Path(page).resolve().as_uri()
    base = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--enable-logging=stderr",
            "--v=0", f"--window-size={size[0]},{size[1]}"]
    r = subprocess.run(base + ["--dump-dom", url], capture_output=True, text=True, timeout=timeout)
    out = {"dom": r.stdout, "console": [m[1] for m in map(CONSOLE.search, r.stderr.splitlines()) if m]}
    if screenshot:
        subprocess.run(base + [f"--screenshot={Path(screenshot).resolve()}", url], capture_output=True,
                       timeout=timeout, check=True)
    return out
