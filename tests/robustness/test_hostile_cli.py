"""Hostile values on the command line: one `error:` line (exit 2) for each bad value, found before a model is
loaded or a comparison is run (both are replaced here by functions that fail the test if they are reached)."""
from __future__ import annotations

import argparse
import threading

import pytest

import llorch_ref
from llorch_ref import cli
from llorch_ref.cli.common import api_token
from llorch_ref.harness import run as harness_run


def one_line_error(capsys, argv, *fragments):
    rc = cli.main(argv)
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, (rc, err)
    for f in fragments:
        assert f in lines[0], lines[0]
    return lines[0]


@pytest.fixture()
def nothing_runs(monkeypatch):
    """Loading a model or running a comparison fails the test: the error must come first."""
    def ran(*a, **k):
        raise AssertionError("the model was loaded or the comparison ran before the bad value was named")
    monkeypatch.setattr(llorch_ref, "load", ran)
    monkeypatch.setattr(harness_run, "run_diff", ran)


@pytest.mark.parametrize("argv,fragment", [
    (["generate", "hi", "--max-tokens", "-1"], "--max-tokens"),
    (["generate", "hi", "--temperature", "-1"], "--temperature"),
    (["generate", "hi", "--repetition-penalty", "0"], "--repetition-penalty"),
    (["generate", "   \t "], "whitespace"),
    (["generate", "hi", "--ctx", "0"], "--ctx"),
    (["chat", "--top-p", "2"], "--top-p"),
])
def test_generate_values_are_checked_before_loading(capsys, nothing_runs, argv, fragment):
    one_line_error(capsys, argv, fragment)


def test_cupy_without_a_gpu_says_what_to_install(capsys, nothing_runs):
    from llorch_ref.backends import available

    if available()["cupy"] is None:
        pytest.skip("this machine has a usable CUDA device")
    one_line_error(capsys, ["generate", "hi", "--backend", "cupy"], "NVIDIA GPU", "llorch-ref[cupy]")


@pytest.mark.parametrize("make_out,run_id,fragment", [
    (lambda d: (d / "file").write_text("x") and d / "file", None, "not a folder"),
    (lambda d: "/proc/llorch-bundles", None, "cannot write"),
    (lambda d: d / "b", "r" * 300, "run id"),
    (lambda d: d / "b", "a\nb", "run id"),
    (lambda d: d / "b", "../escape", "run id"),
    (lambda d: d / "b", ".hidden", "run id"),
])
def test_prove_checks_out_and_run_id_before_the_comparison(tmp_path, capsys, nothing_runs, make_out, run_id,
                                                           fragment):
    argv = ["prove", "--out", str(make_out(tmp_path))] + (["--run-id", run_id] if run_id else [])
    one_line_error(capsys, argv, fragment)


def test_prove_refuses_a_finished_run_id_before_the_comparison(tmp_path, capsys, nothing_runs):
    (tmp_path / "r1").mkdir()                       # a finished run's folder
    (tmp_path / "r1" / "summary.md").write_text("# Proof run r1\n")
    one_line_error(capsys, ["prove", "--out", str(tmp_path), "--run-id", "r1"], "already exists")


def test_dump_token_id_outside_the_vocabulary(tiny, tmp_path, capsys, llamacpp):
    one_line_error(capsys, ["dump", "--engine", "llamacpp", "--model", str(tiny()), "--token-ids", "1,2,99999999",
                            "--out", str(tmp_path / "d.safetensors")], "99999999", "vocabulary")
    assert not (tmp_path / "d.safetensors").exists()


def test_model_on_a_fifo_is_an_error_not_a_hang(tmp_path, capsys):
    import os

    os.mkfifo(tmp_path / "fifo")
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("line", one_line_error(
        capsys, ["generate", "hi", "--model", str(tmp_path / "fifo")], "FIFO")), daemon=True)
    t.start()
    t.join(30)
    assert "line" in result, "llorch-ref hung on a FIFO given as --model"


@pytest.mark.parametrize("argv", [["serve", "--port", "70000"], ["serve", "--port", "0"], ["serve", "--max-queue", "0"]])
def test_serve_numbers_out_of_range(capsys, argv):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err and err.strip().splitlines()[-1].startswith("llorch-ref serve: error:")


def _token_args(**kw):
    return argparse.Namespace(**{"api_token": None, "api_token_file": None, **kw})


def test_api_token_from_file_and_environment(tmp_path, monkeypatch):
    monkeypatch.delenv("LLORCH_API_TOKEN", raising=False)
    assert api_token(_token_args()) is None
    monkeypatch.setenv("LLORCH_API_TOKEN", "from-env")
    assert api_token(_token_args()) == "from-env"
    (tmp_path / "tok").write_text("from-file\n")
    assert api_token(_token_args(api_token_file=str(tmp_path / "tok"))) == "from-file"
    assert api_token(_token_args(api_token="from-argv")) == "from-argv"


@pytest.mark.parametrize("kw", [{"api_token": ""}, {"api_token": " padded "}, {"api_token_file": "/nonexistent"},
                                {"api_token": "a", "api_token_file": "b"}])
def test_empty_or_bad_api_token_is_refused_not_auth_off(kw, monkeypatch):
    from llorch_ref.errors import ParameterError

    monkeypatch.delenv("LLORCH_API_TOKEN", raising=False)
    with pytest.raises(ParameterError):
        api_token(_token_args(**kw))


def test_empty_environment_token_is_refused(monkeypatch):
    from llorch_ref.errors import ParameterError

    monkeypatch.setenv("LLORCH_API_TOKEN", "")
    with pytest.raises(ParameterError, match="LLORCH_API_TOKEN"):
        api_token(_token_args())


class AskedEvent(threading.Event):
    """Becomes set the n-th time it is asked (is_set), as if a client left at that moment."""

    def __init__(self, n):
        super().__init__()
        self.n, self.asked = n, 0

    def is_set(self):
        self.asked += 1
        if self.asked >= self.n:
            self.set()
        return super().is_set()


def test_a_long_prefill_stops_between_layers(tiny):
    """Cancelled during the prefill's second layer: no token is produced (before, the whole prefill ran and
    the cancel was seen only before the first token, after one more had been made)."""
    eng = llorch_ref.load(tiny(n_layers=4))
    from llorch_ref.engine import GenerationResult

    res = GenerationResult()
    cancel = AskedEvent(2)
    out = list(eng.generate_ids(eng.tokenizer.encode("Once upon a time"), max_tokens=5, result=res, cancel=cancel))
    assert out == [] and res.stop_reason == "cancelled" and cancel.asked == 2


@pytest.mark.parametrize("argv, command", [
    (["generate", "hi", "--max-token", "3"], "generate"),      # an abbreviation of --max-tokens: refused
    (["diff", "--checkpont", "3"], "diff"),                     # misspelled
    (["dump", "--engine", "llamacpp", "--out", "x", "--ubatc", "7"], "dump"),
])
def test_a_mistaken_option_gets_the_commands_own_usage(argv, command, capsys):
    from llorch_ref.cli import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: llorch-ref {command} ") and f"llorch-ref {command}: error: unrecognized" in err, err
