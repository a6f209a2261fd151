"""Hostile prompts: control characters, lone surrogates (text that is not valid UTF-8), empty input,
too long for the context: clear errors or correct tokens, never a crash."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

import llorch_ref
from llorch_ref.errors import PromptError, TokenizerError


def test_control_characters_round_trip(engine_q41):
    s = "a\x00b\x07c\x1b[31mred\x1b[0m\x7f\u202eevil\u200d"
    assert engine_q41.tokenizer.decode(engine_q41.tokenizer.encode(s)) == s


def test_lone_surrogate_is_a_clear_error(engine_q41):
    with pytest.raises(TokenizerError, match="UTF-8"):
        engine_q41.tokenizer.encode("bad \udc80 text")


def test_cli_invalid_utf8_argument_is_one_error_line(tiny):
    r = subprocess.run([sys.executable, "-m", "llorch_ref.cli", "generate", os.fsdecode(b"bad \xff bytes"),
                        "--model", str(tiny())], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "UTF-8" in r.stderr


@pytest.mark.parametrize("prompt", ["", None])
def test_empty_prompt(engine_q41, prompt):
    with pytest.raises(PromptError):
        list(engine_q41.generate(prompt))


def test_prompt_over_the_context(tiny):
    eng = llorch_ref.load(tiny(context_length=64))
    with pytest.raises(PromptError, match="context holds 64"):
        list(eng.generate("word " * 200))


def _fifo(d):
    os.mkfifo(d / "fifo")
    return d / "fifo"


TEXT_FILES = [
    (lambda d: d, "is a folder"),
    (_fifo, "not a regular file"),
    (lambda d: "/dev/zero", "not a regular file"),
    (lambda d: d / "missing.txt", "no such file"),
    (lambda d: (d / "empty.txt").write_text(" \n") and d / "empty.txt", "holds no text"),
    (lambda d: (d / "bad.txt").write_bytes(b"ok\xff") and d / "bad.txt", "UTF-8"),
]


@pytest.mark.parametrize("make,fragment", TEXT_FILES, ids=["folder", "fifo", "device", "missing", "blank", "binary"])
def test_a_prompt_file_that_is_not_a_text_file_is_one_error_line_at_once(tmp_path, make, fragment):
    target = make(tmp_path)
    r = subprocess.run([sys.executable, "-m", "llorch_ref.cli", "diff", "--prompt-file", str(target), "--greedy", "0"],
                       capture_output=True, text=True, timeout=60)           # a FIFO read would block: the timeout
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and fragment in lines[0] and "--prompt-file" in lines[0], r.stderr


@pytest.mark.parametrize("make,fragment", TEXT_FILES, ids=["folder", "fifo", "device", "missing", "blank", "binary"])
def test_the_plugin_s_prompt_file_gets_the_cli_s_checks(tmp_path, make, fragment):
    from llorch_ref.errors import ParameterError
    from llorch_ref.pytest_plugin import _prompt

    opts = {"llorch_prompt_file": str(make(tmp_path)), "llorch_prompt": None}
    with pytest.raises(ParameterError, match=fragment):
        _prompt(opts.get)


def test_a_text_file_over_its_limit_is_refused_before_or_while_read(tmp_path):
    from llorch_ref.errors import ParameterError
    from llorch_ref.loaders.text_file import read_text_file

    f = tmp_path / "long.txt"
    f.write_text("word " * 100)
    assert read_text_file(f, "--prompt-file", limit=500) == "word " * 100
    with pytest.raises(ParameterError, match="--prompt-file .*over the limit of 499 bytes"):
        read_text_file(f, "--prompt-file", limit=499)
    f.write_bytes(b"\r\nline\r\n")                       # the file's bytes as they are: CRLF kept
    assert read_text_file(f, "--prompt-file") == "\r\nline\r\n"


def test_an_api_token_file_that_is_a_fifo_is_refused_not_waited_on(tmp_path):
    import argparse

    from llorch_ref.cli.common import api_token
    from llorch_ref.errors import ParameterError

    with pytest.raises(ParameterError, match="--api-token-file .*not a regular file"):
        api_token(argparse.Namespace(api_token=None, api_token_file=str(_fifo(tmp_path))))
