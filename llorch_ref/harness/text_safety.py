"""Text from a bundle, a dump, a GGUF file or a command line, made safe for where it is shown: a terminal
(no character it acts on), Markdown (no markup or HTML of its own, one line) and XML (no character XML 1.0
forbids). Each escape stays visible (`\\x1b`, `\\u202e`, `&lt;`), so what a file holds can still be read."""
from __future__ import annotations

import re

# bidi embeddings, overrides and isolates, marks, line/paragraph separators, BOM: they reorder or break lines
_INVISIBLE = "\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069\ufeff"
_TERMINAL = re.compile(f"[\x00-\x1f\x7f-\x9f{_INVISIBLE}]")
_TERMINAL_LINES = re.compile(f"[\x00-\x08\x0b-\x1f\x7f-\x9f{_INVISIBLE}]")
# XML 1.0's Char: #x9 | #xA | #xD | [#x20-#xD7FF] | [#xE000-#xFFFD] | [#x10000-#x10FFFF]; everything else
_NOT_XML = re.compile("[^\t\n\r\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")
_MARKDOWN = re.compile(r"([\\`*\[\]|])")
_EMPHASIS_UNDERSCORE = re.compile(r"_(?![^\W_])|(?<![^\W_])_")       # not between two letters or digits
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def visible(c: str) -> str:
    """One character as its Python escape: \\n, \\r, \\t by name, else \\xHH below U+0100, else \\uHHHH."""
    o = ord(c)
    return _NAMED.get(c) or (f"\\x{o:02x}" if o < 0x100 else f"\\u{o:04x}" if o < 0x10000 else f"\\U{o:08x}")


def for_terminal(s, newlines: bool = False) -> str:
    """s (str() of any value) with every character a terminal interprets replaced by its visible escape: C0
    controls (ESC, CR, BEL, NUL, ...), DEL, C1 controls (CSI U+009B, ...), bidi overrides and isolates, line
    separators. Newlines and tabs are escaped too (a one-line field cannot start a line of its own), unless
    newlines: then they are kept, as text spanning lines."""
    pattern = _TERMINAL_LINES if newlines else _TERMINAL
    return pattern.sub(lambda m: visible(m.group()), str(s))


def for_markdown(s) -> str:
    """s as literal Markdown text on one line: controls and newlines escaped as for_terminal; &, < and >
    as HTML entities (no tag or entity of its own); \\ ` * [ ] | backslash-escaped (no emphasis, code, link or
    table cell of its own), and _ too unless between two letters or digits (where CommonMark never reads it as
    emphasis: ffn_swiglu stays as it is); a leading # escaped (no heading)."""
    s = for_terminal(s).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    s = _EMPHASIS_UNDERSCORE.sub(r"\\_", _MARKDOWN.sub(r"\\\1", s))
    return "\\" + s if s.startswith("#") else s


def for_markdown_code(s) -> str:
    """s as one Markdown code span: controls and newlines escaped as for_terminal, | as \\| (a table cell ends
    at a bare | even inside a code span; outside a table the backslash shows), fenced by one backtick more than
    its longest run of backticks (padded with spaces where it starts or ends with one), so nothing closes it
    early. HTML inside a code span is shown as text by every Markdown renderer."""
    s = for_terminal(s).replace("|", "\\|")
    fence = "`" * (max((len(r) for r in re.findall("`+", s)), default=0) + 1)
    pad = " " if s.startswith("`") or s.endswith("`") else ""
    return f"{fence}{pad}{s}{pad}{fence}"


def for_markdown_block(s) -> list[str]:
    """s as the lines of a fenced Markdown code block: s on one line (escaped as for_terminal), the fence one
    backtick longer than its longest run of backticks (three at least), so s cannot close the block."""
    s = for_terminal(s)
    fence = "`" * max(3, max((len(r) for r in re.findall("`+", s)), default=0) + 1)
    return [fence, s, fence]


def for_xml(s) -> str:
    """s (str() of any value) with every character XML 1.0 forbids (C0 controls but tab, newline and carriage
    return; lone surrogates; U+FFFE, U+FFFF) replaced by its visible escape. The XML writer's own escaping
    (& < > and quotes in attributes) is done afterwards, by the writer."""
    return _NOT_XML.sub(lambda m: visible(m.group()), str(s))
