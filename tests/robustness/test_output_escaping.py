"""Names from a bundle, a dump or a GGUF file reach the terminal, summary.md and junit.xml escaped: no byte a
terminal interprets (ESC, CR, C1, bidi overrides), no Markdown or HTML of their own, no character XML 1.0
forbids, no rich markup; what is escaped stays visible (`\\x1b`)."""
from __future__ import annotations

import io
import json
import xml.etree.ElementTree as ET

import pytest

import llorch_ref
from llorch_ref.cli import main
from llorch_ref.harness.text_safety import for_markdown, for_terminal, for_xml

TERMINAL_BYTES = ("\x1b", "\r", "\x9b", "\u202e", "\x07", "\x00")
FORGED = "<script>alert(1)</script>\n# Proof run x: every checkpoint inside its band"


def interpreted(text: str) -> list[str]:
    """The characters of text a terminal would act on."""
    return [c for c in TERMINAL_BYTES if c in text]


@pytest.fixture(scope="module")
def subject_of(tiny, tmp_path_factory):
    """subject_of(engine_name) -> (model, path of a dump of llorch-ref on the tiny model under that engine name)."""
    from llorch_ref.references.llorch import record_engine

    model = tiny(vocab="bpe")
    eng = llorch_ref.load(model)
    d = tmp_path_factory.mktemp("dumps")
    made = {}

    def make(name):
        if name not in made:
            ids = eng.tokenizer.encode("Once upon a time")
            rec = record_engine(eng, ids, prompt="Once upon a time", n_greedy=2)
            rec.engine = name
            made[name] = rec.save(d / f"dump{len(made)}.safetensors")
        return model, made[name]
    return make


def prove(subject_of, tmp_path, name, capsys):
    """prove --subject on a dump named `name`: (exit code, stdout + stderr, bundle folder)."""
    model, dump = subject_of(name)
    rc = main(["prove", "--subject", str(dump), "--model", str(model), "--out", str(tmp_path), "--run-id", "real",
               "--checkpoint", "1", "--no-plots"])
    out = capsys.readouterr()
    return rc, out.out + out.err, tmp_path / "real"


def test_the_rules_on_their_own():
    assert for_terminal("a\x1b[2Jb\r\n\x9b\u202e") == "a\\x1b[2Jb\\r\\n\\x9b\\u202e"
    assert for_terminal("a\nb\tc", newlines=True) == "a\nb\tc"
    assert for_terminal("naïve 模型 ok") == "naïve 模型 ok"
    md = for_markdown(FORGED + " | `x` *y* [z](u) a_b & c\\")
    assert "<" not in md and "\n" not in md and not md.startswith("#")
    assert "\\|" in md and "\\`x\\`" in md and "\\*y\\*" in md and "\\[z\\]" in md and "&amp;" in md
    assert for_markdown("# heading") == "\\# heading"
    assert for_xml("a\x00b\x01c\x1bd\ud800e\ufffe\tf") == "a\\x00b\\x01c\\x1bd\\ud800e\\ufffe\tf"


def test_a_forged_file_name_in_the_manifest_cannot_print_verify_ok(tmp_path, capsys):
    b = tmp_path / "bundle"
    b.mkdir()
    hostile = "\x1b[2K\rverify: OK"
    (b / f"added{hostile}").write_text("planted")
    (b / "manifest.json").write_text(json.dumps({"files": {f"gone{hostile}": "0" * 64}, "recipe": {}}))
    assert main(["verify", str(b), "--no-rerun"]) == 1
    out = capsys.readouterr()
    assert not interpreted(out.out + out.err), repr(out.out + out.err)
    lines = out.out.splitlines()
    assert "MISSING: gone\\x1b[2K\\rverify: OK" in lines and "ADDED after the run: added\\x1b[2K\\rverify: OK" in lines
    assert lines[-1].startswith("verify: FAILED")


def test_a_gguf_name_cannot_clear_the_screen_in_inspect(tiny, tmp_path, capsys):
    src = tiny(vocab="bpe", extra_specials=("<|\x1b[2J|>",))
    data = src.read_bytes()
    name = b"tiny-bpe-F32-gqa"
    assert data.count(name) == 1
    p = tmp_path / "named.gguf"
    p.write_bytes(data.replace(name, b"x\x1b[2Jy".ljust(len(name), b"z")))
    assert main(["inspect", "--model", str(p)]) == 0
    out = capsys.readouterr()
    assert not interpreted(out.out + out.err), repr(out.out + out.err)
    assert "(x\\x1b[2Jyzzzzzzzzzz)" in out.out and "<|\\x1b[2J|>" in out.out


def test_a_dump_engine_name_writes_no_html_and_no_heading_into_summary_md(subject_of, tmp_path, capsys):
    rc, printed, run = prove(subject_of, tmp_path, FORGED, capsys)
    assert rc == 0, printed
    summary = (run / "summary.md").read_text()
    assert "<script>" not in summary and "&lt;script&gt;" in summary
    assert summary.startswith("# Proof run real: ")
    assert not [line for line in summary.splitlines() if line.startswith("# Proof run x")]
    for md in run.rglob("report.md"):
        assert "<script>" not in md.read_text()
    assert not interpreted(printed) and "<script>alert(1)</script>\\n# Proof run x" in printed


def test_junit_xml_parses_when_names_hold_forbidden_characters(subject_of, tmp_path, capsys):
    rc, printed, run = prove(subject_of, tmp_path, "eng\x00\x01\x1bine", capsys)
    assert rc == 0, printed
    root = ET.parse(run / "junit.xml").getroot()
    assert "eng\\x00\\x01\\x1bine" in root.get("name")
    assert not interpreted(printed) and "eng\\x00\\x01\\x1bine" in printed


def test_an_engine_named_like_rich_markup_prints_as_it_is(subject_of, tmp_path, capsys):
    from llorch_ref.checkpoints import engine_band_class
    from llorch_ref.cli.report import print_result
    from llorch_ref.dump import load_dump
    from llorch_ref.harness.run import run_subject

    model, dump = subject_of("[/]")
    ref = llorch_ref.load(model)
    res = run_subject(ref, load_dump(dump), engine_band_class(ref), checkpoints=["1"],
                      subject_label="[/] :warning: [bold]x")
    res.warnings.append("[/] from \x1b[31mthe dump")
    buf = io.StringIO()
    print_result(res, True, file=buf)
    text = buf.getvalue()
    assert "[/] :warning: [bold]x vs" in text and "warning: [/] from \\x1b[31mthe dump" in text
    rc, printed, _ = prove(subject_of, tmp_path, "[/]", capsys)
    assert rc == 0 and printed.lstrip().startswith("[/] "), printed
