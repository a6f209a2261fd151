"""What the tree must hold for a newcomer: results/ is evidence (no scripts, every file cited and saying how it was
made), the documents state the current facts (no numbered work periods or device runs, no "was X -> Y"), and
docs/performance.md stays a page of current tables."""
from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Words that tell the path to a fact instead of the fact. "calls? N" takes one or two digits, so that text such as
# "Call 555-0123" in a tokenizer test's corpus is not a call number.
ROUND = "r" + "ound"                # spelt apart so this file does not match its own rule
HISTORY = re.compile(r"\bsessions? [0-9]|\bcalls? [0-9]{1,2}\b|\b" + ROUND + r" (two|three|2|3)\b|\bwas [0-9.]+x? ?(->|→)"
                     r"|\bas before\b|\bearlier sessions?\b", re.IGNORECASE)
HISTORY_IN_NAMES = re.compile(r"(session|round|call)[-_]?[0-9]|(^|[-_/])s[0-9]{2}([-_/.]|$)", re.IGNORECASE)
# Files whose owners are still rewriting them (their history words are theirs to remove); each entry goes once the
# file is clean.
PENDING: set = set()
SCRIPTS = (".py", ".sh", ".ipynb")
CITING = ("docs/", "README.md", "results/README.md", "proof_bundle/README.md", "llorch_ref/", "tools/")
PERFORMANCE_LINES = 260


def tracked() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return sorted({p for p in out.splitlines() if (ROOT / p).is_file()})


def text(path: str) -> str | None:
    """The file as text, or None for a binary one (a NUL byte, or not UTF-8)."""
    data = (ROOT / path).read_bytes()
    if b"\0" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def results_files() -> list[str]:
    return [p for p in tracked() if p.startswith("results/")]


def test_no_scripts_under_results():
    scripts = [p for p in results_files() if p.endswith(SCRIPTS)]
    assert not scripts, f"results/ holds evidence, not code; a measurement is repeated by a tool under tools/: {scripts}"


def test_no_history_words_in_the_tree():
    found = []
    for p in tracked():
        if p == "tests/test_house.py" or p in PENDING or (p.startswith("results/") and p.endswith((".json", ".jsonl"))):
            continue
        body = text(p)
        if body is None:
            continue
        for n, line in enumerate(body.splitlines(), 1):
            m = HISTORY.search(line)
            if m:
                found.append(f"{p}:{n}: {m.group(0)!r} in {line.strip()[:100]!r}")
    assert not found, "state the current fact (what led there is in git log):\n" + "\n".join(found)


def test_no_history_words_in_file_names():
    named = [p for p in tracked() if HISTORY_IN_NAMES.search(p)]
    assert not named, f"name a file by what it holds, not by when it was made: {named}"


def test_performance_doc_is_a_page_of_current_tables():
    doc = (ROOT / "docs/performance.md").read_text()
    assert len(doc.splitlines()) <= PERFORMANCE_LINES, "docs/performance.md: one current table per CPU and GPU"
    assert not re.search(r"^#+ .*\bsession\b", doc, re.IGNORECASE | re.MULTILINE)


def _stem(name: str) -> str:
    """A name without its last extension: a run's .md, .json and .png share it."""
    return name.rsplit(".", 1)[0] if "." in name.rsplit("/", 1)[-1] else name


def test_every_results_file_is_cited():
    """Cited by its full path in a document, the README or a module's comment, or named (file, or the stem its
    .md/.json/.png share) in results/README.md."""
    citing = "\n".join(body for p in tracked() if p.startswith(CITING) and not p.startswith("results/")
                       and (body := text(p)) is not None)
    named = set()
    for token in re.findall(r"`([^`\s]+)`", (ROOT / "results/README.md").read_text()):
        named |= {token, _stem(token), token.rsplit("/", 1)[-1], _stem(token.rsplit("/", 1)[-1])}
    uncited = []
    for p in results_files():
        rel = p[len("results/"):]
        name = rel.rsplit("/", 1)[-1]
        if p == "results/README.md" or p in citing or named & {rel, _stem(rel), name, _stem(name)}:
            continue
        uncited.append(p)
    assert not uncited, f"cite these from a document or results/README.md, or delete them (git keeps them): {uncited}"


def test_every_results_file_says_how_it_was_made():
    unsaid = []
    for p in results_files():
        body = text(p)
        if body is None or p == "results/README.md":
            continue                     # images: results/README.md names the command that wrote them
        if p.endswith(".json"):
            made = json.loads(body).get("made_by", {}) if body.lstrip().startswith("{") else {}
            if not (made.get("commit") and made.get("command")) or next(iter(json.loads(body))) != "made_by":
                unsaid.append(p)
        elif not re.search(r"\b[0-9a-f]{7,40}\b", "\n".join(body.splitlines()[:12])):
            unsaid.append(p)
    assert not unsaid, f"give each file its command and commit in its first lines (JSON: a first key made_by): {unsaid}"
