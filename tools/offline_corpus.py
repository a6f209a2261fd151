"""A corpus of at least --tokens tokens of a model's tokenizer from text present without a network: Debian's
license texts (/usr/share/common-licenses, every regular file once, in name order), or the repository's docs/*.md
where that folder is absent, the whole repeated as often as needed (wikitext-2's test split is about 300k tokens).

    python tools/offline_corpus.py --model M.gguf --tokens 300000 --out /tmp/corpus.txt
    llorch-ref eval --model M.gguf --subject cupy --reference-backend cupy --text /tmp/corpus.txt --ctx 512

Prints one JSON line: the source folder, its files, the sha256 of one copy, the copies, the bytes and the tokens
of one copy (eval reads the whole file, so --chunks bounds a run by the chunks it takes).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = (Path("/usr/share/common-licenses"), ROOT / "docs")


def texts(folder: Path) -> list[tuple[str, str]]:
    """(name, text) of every regular file of folder readable as UTF-8 (links to a file already read: once)."""
    seen, out = set(), []
    for p in sorted(folder.iterdir()):
        real = p.resolve()
        if not real.is_file() or real in seen or (folder == ROOT / "docs" and p.suffix != ".md"):
            continue
        try:
            out.append((p.name, real.read_text(encoding="utf-8")))
        except (OSError, UnicodeDecodeError):
            continue
        seen.add(real)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="GGUF file whose tokenizer counts the tokens")
    ap.add_argument("--tokens", type=int, default=300_000)
    ap.add_argument("--source", type=Path, default=None,
                    help=f"folder of text files (default: the first of {', '.join(map(str, SOURCES))} present)")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    folder = a.source or next((s for s in SOURCES if s.is_dir()), None)
    if folder is None or not folder.is_dir():
        print(f"offline_corpus: no text folder (tried {a.source or ', '.join(map(str, SOURCES))})", file=sys.stderr)
        return 2
    parts = texts(folder)
    if not parts:
        print(f"offline_corpus: {folder} holds no UTF-8 text file", file=sys.stderr)
        return 2
    one = "\n\n".join(t.strip("\n") for _, t in parts) + "\n\n"
    import llorch_ref
    tok = llorch_ref.load(a.model, weights="lazy").tokenizer
    if tok is None:
        print(f"offline_corpus: {a.model} has no vocabulary", file=sys.stderr)
        return 2
    per_copy = len(tok.encode(one))
    copies = max(1, -(-a.tokens // per_copy))
    a.out.write_text(one * copies, encoding="utf-8")
    print(json.dumps({"source": str(folder), "files": [n for n, _ in parts],
                      "sha256_one_copy": hashlib.sha256(one.encode()).hexdigest(), "copies": copies,
                      "bytes": len(one.encode()) * copies, "tokens_one_copy": per_copy,
                      "tokens_about": per_copy * copies, "out": str(a.out)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
