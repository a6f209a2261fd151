"""The verdict: one object (harness/verdict.py) that every face renders, and a true one. Planted cache bugs are
named at their checkpoint, layer, step and row; nothing covered is not a pass; the ids a dump ran are tied to
its prompt; the CLI, the Python API and the pytest plugin give one verdict for one file."""
from __future__ import annotations

import json

import numpy as np
import pytest
from llorch_test_helpers import where

from llorch_ref.cli import main
from llorch_ref.dump import MANIFEST_KEY, Recorder, load_dump
from llorch_ref.harness.compare import compare_dumps
from llorch_ref.harness.run import check_dump, run_subject
from llorch_ref.harness.verdict import FAIL, INCOMPLETE, PASS
from llorch_ref.references.llorch import record_engine
from llorch_ref.testing.plant import CACHE_BUGS

PROMPT = "Once upon a time, there was"
STEPS = 3


def planted_dump(eng, monkeypatch, plant, rows=None, steps=STEPS):
    ids = eng.tokenizer.encode(PROMPT)
    with monkeypatch.context() as mp:
        if plant is not None:
            plant(mp, len(ids))
        return record_engine(eng, ids, prompt=PROMPT, n_greedy=8, decode_steps=steps, rows=rows)


def diff_cli(path, model, *extra, capsys=None):
    rc = main(["diff", "--subject", str(path), "--model", str(model), *extra])
    return rc, (capsys.readouterr().out if capsys else "")


@pytest.mark.parametrize("name", list(CACHE_BUGS))
def test_a_cache_bug_is_named_at_its_step_checkpoint_layer_and_row(bpe_engine, monkeypatch, name):
    plant, expect = CACHE_BUGS[name]
    sub = planted_dump(bpe_engine, monkeypatch, plant).to_dump()
    res = run_subject(bpe_engine, sub)
    v = res.verdict()
    assert v.status == FAIL and v.exit_code == 1
    assert where(v.first_divergence) == expect, v.first_divergence
    row = min((r for r in res.rows if r.diverges), key=lambda r: r.order)
    assert row.local_passed is False and "positions" in row.local["error"]
    assert any(p in row.local["error"] for p in ("[0, 1, 2, 3]", "[2]")), row.local["error"]


@pytest.mark.parametrize("name", ["cache rows 0..3 scaled in the prompt", "a stale row from a previous sequence"])
def test_a_rows_only_dump_of_a_cache_bug_fails_at_the_cache(bpe_engine, monkeypatch, name, tmp_path, capsys):
    """A dump of the last row only (as `dump --rows last` writes): the unheld rows the attention reads are
    checked end to end; the verdict is FAIL through the CLI too."""
    plant, _ = CACHE_BUGS[name]
    ids = bpe_engine.tokenizer.encode(PROMPT)
    path = planted_dump(bpe_engine, monkeypatch, plant, rows=[len(ids) - 1], steps=0).save(tmp_path / "d.safetensors")
    v = run_subject(bpe_engine, load_dump(path)).verdict()
    assert where(v.first_divergence) == (0, "3", 0, "k_cache"), v.first_divergence
    rc, out = diff_cli(path, bpe_engine.path, capsys=capsys)
    assert rc == 1 and "verdict: FAIL" in out


def test_a_rows_only_dump_with_one_wrong_early_row_fails(bpe_engine, tmp_path):
    ids = bpe_engine.tokenizer.encode(PROMPT)
    rec = record_engine(bpe_engine, ids, prompt=PROMPT, n_greedy=0, rows=[len(ids) - 1])
    rec.tensors["cp3.v_cache.layer1"][1] *= 2.0            # position 1, never held as a row of the dump
    v = run_subject(bpe_engine, rec.to_dump()).verdict()
    assert where(v.first_divergence) == (0, "3", 1, "v_cache")
    assert v.first_divergence["positions"] == [1]


def test_the_clean_engine_passes_with_every_row_checked(bpe_engine, monkeypatch):
    res = run_subject(bpe_engine, planted_dump(bpe_engine, monkeypatch, None).to_dump())
    assert res.verdict().status == PASS, res.verdict().line()
    step2 = next(r for r in res.rows if r.tensor == "k_cache@step2" and r.layer == 0)
    n = len(bpe_engine.tokenizer.encode(PROMPT))
    assert step2.local["rows"] == {"written": 1, "against_earlier_write": n + 1, "against_reference": 0}


def test_a_local_figure_that_did_not_cover_the_greedy_tokens_excuses_nothing(bpe_engine, monkeypatch):
    """Greedy tokens that part after the first one, in a dump without decode steps: only the first is the
    subject's own logits' choice, so the end-to-end failure stands."""
    ids = bpe_engine.tokenizer.encode(PROMPT)
    rec = record_engine(bpe_engine, ids, prompt=PROMPT, n_greedy=8)
    g = rec.tensors["cp12.greedy_tokens"]
    g[3:] = (g[3:] + 1) % bpe_engine.config.n_vocab
    res = run_subject(bpe_engine, rec.to_dump())
    row = next(r for r in res.rows if r.checkpoint == "12")
    assert row.local_passed and not row.local_covers and row.diverges
    assert res.verdict().status == FAIL


# -- not covered is not passed --------------------------------------------------------------------------------

def _sparse_dump(eng, names, tmp_path):
    ids = eng.tokenizer.encode(PROMPT)
    full = record_engine(eng, ids, prompt=PROMPT, n_greedy=0)
    rec = Recorder("my-engine", "1", model_path=eng.path, token_ids=ids, prompt=PROMPT)
    for n in names:
        rec.tensors[n] = full.tensors[n]
    return rec.save(tmp_path / f"sparse{len(names)}.safetensors")


@pytest.mark.parametrize("names", [[], ["cp7.l_out.layer0"]])
def test_a_dump_that_covers_nothing_or_one_tensor_is_incomplete(bpe_engine, tmp_path, capsys, names):
    path = _sparse_dump(bpe_engine, names, tmp_path)
    rc, out = diff_cli(path, bpe_engine.path, capsys=capsys)
    assert rc == 3, out
    assert "verdict: INCOMPLETE" in out and "required tensors not compared" in out
    assert check_dump(path, model=bpe_engine.path).verdict().status == INCOMPLETE


def test_require_chooses_what_a_pass_needs(bpe_engine, tmp_path, capsys):
    path = _sparse_dump(bpe_engine, ["cp7.l_out.layer0", "cp7.l_out.layer1"], tmp_path)
    rc, out = diff_cli(path, bpe_engine.path, "--require", "7", capsys=capsys)
    assert rc == 0 and "verdict: PASS" in out, out
    assert diff_cli(path, bpe_engine.path, "--require", "7,cp3.k_cache")[0] == 3
    assert diff_cli(path, bpe_engine.path, "--require", "nonesuch")[0] == 2


def test_a_declared_decode_step_without_tensors_is_incomplete(bpe_engine, monkeypatch):
    rec = planted_dump(bpe_engine, monkeypatch, None, steps=2)
    for n in [n for n in rec.tensors if n.endswith(".step2")]:
        del rec.tensors[n]
    v = run_subject(bpe_engine, rec.to_dump()).verdict()
    assert v.status == INCOMPLETE and any("@step2" in r for r in v.reasons), v.reasons


# -- the prompt is tied to the ids ------------------------------------------------------------------------------

def test_a_prompt_that_does_not_tokenize_to_the_ids_fails_at_cp0(bpe_engine, tmp_path, capsys):
    ids = bpe_engine.tokenizer.encode(PROMPT)
    other = bpe_engine.tokenizer.encode("A wholly different text, that never ran")
    rec = record_engine(bpe_engine, other, prompt=PROMPT, n_greedy=0)
    rec.tensors["cp0.token_ids"] = np.array(ids, np.int64)          # the engine's tokenization of the prompt shown
    path = rec.save(tmp_path / "d.safetensors")
    v = check_dump(path, model=bpe_engine.path).verdict()
    assert v.status == FAIL and v.first_divergence["checkpoint"] == "0", v.line()
    assert v.first_divergence["tensor"] == "ran_token_ids"
    assert diff_cli(path, bpe_engine.path)[0] == 1


def test_integer_logits_are_refused(bpe_engine, tmp_path, capsys):
    rec = record_engine(bpe_engine, bpe_engine.tokenizer.encode(PROMPT), prompt=PROMPT, n_greedy=0)
    from safetensors.numpy import save_file
    t = dict(rec.tensors)
    t["cp9.logits"] = np.round(t["cp9.logits"]).astype(np.int32)
    save_file(t, str(tmp_path / "d.safetensors"), metadata={MANIFEST_KEY: json.dumps(rec.manifest())})
    assert diff_cli(tmp_path / "d.safetensors", bpe_engine.path)[0] == 2
    assert "must hold floating-point values" in capsys.readouterr().err


def test_summary_counts_what_the_verdict_counts(bpe_engine, monkeypatch):
    """A row that fails by its local error while inside its end-to-end band counts as failed in the summary."""
    plant, _ = CACHE_BUGS["cache rows 0..3 scaled after decode step 1"]
    res = run_subject(bpe_engine, planted_dump(bpe_engine, monkeypatch, plant).to_dump())
    cp3 = next(s for s in res.summary() if s["checkpoint"] == "3")
    assert cp3["failed"] == sum(r.diverges for r in res.rows if r.checkpoint == "3") > 0
    assert cp3["passed"] is False
    assert res.to_json()["verdict"]["status"] == FAIL and res.to_json()["passed"] is False


def test_compare_dumps_without_a_local_engine_still_judges_coverage(bpe_engine):
    ids = bpe_engine.tokenizer.encode(PROMPT)
    a = record_engine(bpe_engine, ids, prompt=PROMPT, n_greedy=0)
    res = compare_dumps(a, a, bpe_engine.config, "F32")
    assert res.verdict().status == PASS                    # the greedy text is optional unless required
    assert res.verdict(require="all").status == INCOMPLETE     # no cp12 recorded here
    assert res.verdict(require="1,2,3,4,5,6,7").status == PASS
