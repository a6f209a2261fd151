"""`llorch-ref diff --subject openai:URL` against a running `llorch-ref serve` of the default model: the reference
as its own black box gives KLD exactly 0 at every step, on both routes, with the top K and with the whole
vocabulary; the same server on a file with one planted matrix fails at a named step."""
from __future__ import annotations

import json

import pytest

from llorch_ref.cli import main
from llorch_ref.testing.openai_server import llorch_serve

PROMPT = "Once upon a time, there was a little"


@pytest.fixture(scope="module")
def model(default_model):
    return default_model


@pytest.fixture(scope="module")
def served(model):
    with llorch_serve(model) as url:
        yield url


def diff_json(capsys, url, *extra):
    rc = main(["diff", "--threads", "1", "--subject", f"openai:{url}", "--prompt", PROMPT, "--json", *extra])
    out = capsys.readouterr()
    return rc, json.loads(out.out)


@pytest.mark.parametrize("extra", [("--decode-steps", "8"), ("--decode-steps", "3", "--top-logprobs", "49152"),
                                   ("--decode-steps", "3", "--top-logprobs", "49152", "--chat")],
                         ids=["top20", "whole-vocabulary", "chat-whole-vocabulary"])
def test_the_reference_served_is_its_own_black_box_with_kld_exactly_zero(served, capsys, extra):
    rc, res = diff_json(capsys, served, *extra)
    rows = [r for r in res["rows"] if r["checkpoint"] == "11"]
    assert rc == 0 and res["verdict"]["status"] == "PASS", res["verdict"]
    assert rows and all(r["kld"] == 0.0 and r["rank"] == 1 and r["logprob_diff"] == 0.0 for r in rows), \
        [(r["kld"], r["rank"]) for r in rows]
    cp0 = next(r for r in res["rows"] if r["checkpoint"] == "0")
    assert cp0["how"] == "tokenize route /tokenize" and cp0["agreement"] == 1.0


def test_the_served_reference_on_a_planted_file_fails_at_a_named_step(blackbox_planted, capsys):
    with llorch_serve(blackbox_planted) as url:            # blk.29.ffn_down.weight x 1.5 (blackbox_helpers.PLANT)                  # its first failing step is 3 of 8 and of 5
        rc, res = diff_json(capsys, url, "--decode-steps", "5")
    fd = res["verdict"]["first_divergence"]
    assert rc == 1 and fd["checkpoint"] in ("10", "11") and isinstance(fd["step"], int), fd
    assert max(r["kld"] for r in res["rows"] if r["checkpoint"] == "11") > 0.0


def test_eval_of_the_served_reference_by_echo_gives_kld_exactly_zero(served, tmp_path, capsys):
    out = tmp_path / "eval.json"
    rc = main(["eval", "--subject", f"openai:{served}", "--ctx", "16", "--chunks", "2", "--threads", "1",
               "--json", str(out)])
    capsys.readouterr()
    res = json.loads(out.read_text())
    st, how = res["statistics"], res["blackbox"]
    assert rc == 0 and how["method"] == "echo" and how["requests"] == 2 and how["nll_bounded"] == 0, how
    assert st["Maximum KLD"] == 0.0 and st["Mean PPL(Q)"] == st["Mean PPL(base)"] and st["Same top p"][0] == 1.0
