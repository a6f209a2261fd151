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
