"""llorch-ref sweep: the matrix, its exit codes, shrinking to the smallest case, its outputs, and Ray. The planted
bugs (tests/sweep_subjects.py) are each found and shrunk to their exact smallest case, from matrices that do not
hold that case, so the shrink itself must find it."""
from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import numpy as np
import pytest

from llorch_ref.cli import main
from llorch_ref.harness.compare import dims_of, one_token_rows, subject_getter
from llorch_ref.harness.local import local_outputs
from llorch_ref.harness.run import run_subject
from llorch_ref.harness.sweep import (
    Cell,
    CellRunner,
    LocalExecutor,
    Plan,
    RayExecutor,
    boundaries,
    cells_of,
    make_spec,
    parse_int_list,
    run_sweep,
)
from llorch_ref.harness.sweep_batch import dump_llamacpp_batch, sequence_prompts
from llorch_ref.references.engines import dump_llamacpp


@pytest.fixture(scope="module")
def model(tiny):
    return str(tiny())


def sweep(capsys, tmp_path, model, *args):
    """-> (exit code, the JSON) of `llorch-ref sweep --model M ARGS --json F`."""
    out = tmp_path / "sweep.json"
    rc = main(["sweep", "--model", model, *args, "--json", str(out), "--overwrite"])
    capsys.readouterr()
    return rc, json.loads(out.read_text())


def test_length_specs_and_the_engine_boundaries():
    assert parse_int_list("1,2,3,31-33", "--lengths", 1) == [1, 2, 3, 31, 32, 33]
    assert parse_int_list("1-5", "--lengths", 1) == [1, 2, 3, 4, 5]
    assert boundaries(129) == [1, 2, 3, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129]
    assert parse_int_list("boundaries:16", "--lengths", 1) == [1, 2, 3, 7, 8, 9, 15, 16]


@pytest.mark.parametrize("args,says", [
    (["--subject", "llamacpp", "--lengths", "5-1"], "runs backwards"),
    (["--subject", "llamacpp", "--lengths", "0-3"], "below 1"),
    (["--subject", "llamacpp", "--lengths", "1", "--settings", "n_batch=1"], "not a setting"),
    (["--subject", "llamacpp", "--lengths", "1", "--settings", "kv_dtype=q8"], "kv_dtype"),
    (["--subject", "nomodule", "--lengths", "1"], "MODULE:FUNCTION"),
    (["--subject", "no_such_module_here:f", "--lengths", "1"], "cannot import no_such_module_here"),
    (["--subject", "sweep_subjects:no_such_subject", "--lengths", "1"], "sweep_subjects has no no_such_subject"),
    (["--subject", "sweep_subjects:_ENGINES", "--lengths", "1"], "_ENGINES is not callable"),
    (["--subject", "sweep_subjects:clean", "--lengths", "1-500"], "context"),
    (["--subject", "llamacpp", "--lengths", "1", "--ray", "127.0.0.1:9"], "no Ray cluster answers"),
])
def test_a_bad_spec_is_one_error_line_and_exit_2(capsys, model, args, says):
    rc = main(["sweep", "--model", model, *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("error: ") and says in err[0], err


def test_the_matrix_is_settings_then_steps_then_lengths():
    spec = make_spec("m:f", lengths="1,2", steps="0,1", settings=["a=x,y"])
    assert cells_of(spec)[:3] == [Cell(1, 0, (("a", "x"),)), Cell(2, 0, (("a", "x"),)), Cell(1, 1, (("a", "x"),))]
    assert len(cells_of(spec)) == 8


def test_a_clean_subject_passes_every_cell(capsys, tmp_path, model):
    rc, out = sweep(capsys, tmp_path, model, "--subject", "sweep_subjects:clean", "--lengths", "1,2,9", "--steps", "0,2")
    assert rc == 0 and out["status"] == "PASS" and out["counts"]["PASS"] == 6 and out["smallest_failing"] is None
    assert [(c["length"], c["steps"]) for c in out["cells"]] == [(1, 0), (2, 0), (9, 0), (1, 2), (2, 2), (9, 2)]


def test_incomplete_cells_and_no_failing_one_exit_3(capsys, tmp_path, model):
    rc, out = sweep(capsys, tmp_path, model, "--subject", "sweep_subjects:holds_no_ffn", "--lengths", "1,2")
    assert rc == 3 and out["counts"] == {"PASS": 0, "FAIL": 0, "INCOMPLETE": 2}
    assert "cp6" in out["cells"][0]["reasons"][0]


def test_wrong_at_3_mod_32_is_shrunk_to_3_tokens(capsys, tmp_path, model):
    rc, out = sweep(capsys, tmp_path, model, "--subject", "sweep_subjects:wrong_at_3_mod_32", "--lengths", "33-40")
    assert rc == 1
    assert [c["length"] for c in out["cells"] if c["status"] == "FAIL"] == [35]
    s = out["smallest_failing"]
    assert s["label"] == "L3 s0" and s["cell"]["first_divergence"]["tensor"] == "logits"
    assert s["command"].endswith("--lengths 3 --steps 0")
    assert [c["length"] for c in out["shrink_cells"]] == [1, 2, 3]      # each length below 35 until one fails


def test_wrong_when_ubatch_splits_is_shrunk_to_one_more_token_than_the_ubatch(capsys, tmp_path, model):
    rc, out = sweep(capsys, tmp_path, model, "--subject", "sweep_subjects:wrong_when_ubatch_splits",
                    "--lengths", "10,20", "--settings", "n_ubatch=512,4")
    assert rc == 1 and out["counts"]["FAIL"] == 2
    assert out["smallest_failing"]["label"] == "L5 s0 n_ubatch=4"
    assert "--settings n_ubatch=4" in out["smallest_failing"]["command"]


def test_wrong_from_decode_step_5_is_shrunk_to_step_5_on_one_token(capsys, tmp_path, model):
    rc, out = sweep(capsys, tmp_path, model, "--subject", "sweep_subjects:wrong_from_step_5",
                    "--lengths", "4", "--steps", "0,8")
    assert rc == 1 and [c["status"] for c in out["cells"]] == ["PASS", "FAIL"]
    s = out["smallest_failing"]
    assert s["label"] == "L1 s5" and s["cell"]["first_divergence"]["step"] == 5
    rc, again = sweep(capsys, tmp_path, model, *s["command"].split()[2:])      # the command reproduces it
    assert rc == 1 and again["cells"][0]["first_divergence"] == s["cell"]["first_divergence"]


def test_junit_report_and_bundles_of_the_failing_cells(capsys, tmp_path, model):
    rep = tmp_path / "rep"
    rc = main(["sweep", "--model", model, "--subject", "sweep_subjects:wrong_when_ubatch_splits", "--lengths", "3,6",
               "--settings", "n_ubatch=512,4", "--report", str(rep), "--junit", str(tmp_path / "j.xml")])
    assert rc == 1
    assert "smallest failing case: L5 s0 n_ubatch=4" in capsys.readouterr().out
    cases = ET.parse(tmp_path / "j.xml").getroot().findall(".//testcase")
    assert [c.get("name") for c in cases] == ["L3 s0 n_ubatch=512", "L6 s0 n_ubatch=512", "L3 s0 n_ubatch=4",
                                              "L6 s0 n_ubatch=4"]
    assert [c.find("failure") is not None for c in cases] == [False, False, False, True]
    page = (rep / "report.html").read_text()
    assert page.count('class="cell" data-status="FAIL"') == 1 and page.count('data-status="PASS"') == 3
    assert 'href="bundles/L6-s0-n_ubatch-4/report.html"' in page
    assert (rep / "bundles" / "L6-s0-n_ubatch-4" / "report.html").is_file()
    assert json.loads((rep / "sweep.json").read_text())["status"] == "FAIL"


def test_a_local_ray_gives_the_in_process_cells_and_a_dead_actor_s_cell_runs_once(model, tmp_path, monkeypatch):
    pytest.importorskip("ray", reason="Ray is not installed (pip install 'llorch-ref[ray]')")
    monkeypatch.setenv("LLORCH_SWEEP_MARKER", str(tmp_path / "died"))
    monkeypatch.setenv("PYTHONPATH", str(__import__("pathlib").Path(__file__).parent))
    spec = make_spec("sweep_subjects:dies_once", model=model, lengths="1-4", settings=["n_ubatch=512,2"])
    plan = Plan(subject=spec.subject, model=model, text=spec.text)
    ray_ex = RayExecutor(plan, n_actors=2)
    try:
        there = run_sweep(spec, ray_ex)
    finally:
        ray_ex.close()
    here = run_sweep(make_spec("sweep_subjects:clean", model=model, lengths="1-4", settings=["n_ubatch=512,2"]),
                     LocalExecutor(Plan(subject="sweep_subjects:clean", model=model, text=spec.text)))
    strip = lambda cells: [{k: v for k, v in c.items() if k != "seconds"} for c in cells]    # noqa: E731
    assert (tmp_path / "died").exists() and ray_ex.rerun == 1 and "1 cell(s) rerun" in there.where
    assert strip(there.cells) == strip(here.cells) and len(there.cells) == 8


@pytest.mark.llamacpp
def test_a_one_token_micro_batch_is_judged_by_the_product_llamacpp_used(llamacpp, default_model):
    """8 tokens with n_ubatch 7 on an f16 cache: llama.cpp computes row 7 alone (vec_dot, not tinyBLAS), and
    the f16 rounding of its probabilities turns that product's last-bit difference into a visible kqv_out one.
    The reference's local attention, by each row's own micro-batch, gives llama.cpp's rows bit for bit; taken as
    one batch of 8, row 7 differs on some layer."""
    runner = CellRunner(Plan(subject="llamacpp", model=str(default_model), text=make_spec("llamacpp", lengths="8").text, threads=1))
    cell = Cell(8, 0, (("n_ubatch", 7), ("kv_dtype", "float16"), ("flash_attn", False)))
    assert runner.run(cell)["status"] == "PASS"
    ids = runner.base[:8]
    sub = runner.subject(str(runner.engine.path), ids, 0, cell.settings)
    eng = runner.reference(sub)
    assert one_token_rows(sub) == [False] * 7 + [True]
    cfg = eng.config
    get = subject_getter(eng, sub, dims_of(cfg, 8, past=0, n_rows=8))
    as_one, by_batch = [], []
    for layer in range(cfg.n_layers):
        held = get("kqv_out", layer)
        for flags, out in ((None, as_one), (one_token_rows(sub), by_batch)):
            lo = local_outputs(eng, get, layer, ids, one_token=flags, only={"kqv_out"})["kqv_out"]
            out.append(float(np.abs(lo - held).max()))
    assert max(by_batch) == 0.0 and max(as_one) > 0.0


def test_wrong_for_the_second_sequence_is_shrunk_to_two_sequences_of_one_token(capsys, tmp_path, model):
    rc, out = sweep(capsys, tmp_path, model, "--subject", "sweep_subjects:wrong_for_the_second_sequence",
                    "--lengths", "4,6", "--settings", "n_seq=1,4")
    assert rc == 1
    failing = [c for c in out["cells"] if c["status"] == "FAIL"]
    assert [(c["length"], c["settings"]["n_seq"]) for c in failing] == [(4, 4), (6, 4)]
    assert all(c["sequence"] == 1 and c["sequences"].count("FAIL") == 1 and c["sequences"][1] == "FAIL"
               for c in failing)
    assert all("sequence" not in c for c in out["cells"] if c["settings"]["n_seq"] == 1)
    s = out["smallest_failing"]
    assert s["label"] == "L1 s0 n_seq=2" and s["cell"]["first_divergence"]["tensor"] == "logits"
    assert s["cell"]["reasons"][0].startswith("sequence 1 of 2: ")


@pytest.mark.llamacpp
def test_each_sequence_of_a_llamacpp_batch_holds_what_it_holds_alone(llamacpp, default_model):
    """Two sequences of 5 tokens in one batch, a decode step each (f32 cache): every tensor of each sequence's
    dump (its rows, its own cache cells, its rows' scores against its own cells, its logits) equals the same
    sequence's run alone to the bit, but the softmax and P.V, whose sums run over the sequence's cache cells
    (elsewhere in a shared cache): a few f32 ulps. The local reference, the keys placed at those cells, gives
    every tensor to the bit. A mask that let one sequence see the other's keys, or a row or cell taken from
    the wrong sequence, would differ far beyond that."""
    runner = CellRunner(Plan(subject="llamacpp", model=str(default_model), text=make_spec("llamacpp", lengths="5").text,
                             threads=1))
    seqs = sequence_prompts(runner.base, 5, 2)
    assert seqs[0] != seqs[1]
    both = dump_llamacpp_batch(default_model, seqs, decode_steps=1, n_threads=1)
    summed = ("cp4.kq_soft_max.", "cp5.kqv_out.")
    for ids, rec in zip(seqs, both):
        alone = dump_llamacpp(default_model, token_ids=ids, n_greedy=0, decode_steps=1, n_threads=1)
        names = set(alone.tensors) & set(rec.tensors)
        assert len(names) > 200 and {n for n in alone.tensors if n.startswith("cp")} <= names | {"cp0.token_ids"}
        diff = {n: float(np.abs(rec.tensors[n] - alone.tensors[n]).max()) for n in names}
        assert max(d for n, d in diff.items() if not n.startswith(summed)) == 0.0
        assert max(diff.values()) < 1e-6
        assert rec.extra["decode_token_ids"] == alone.extra["decode_token_ids"]
        sub = rec.to_dump()
        res = run_subject(runner.reference(sub), sub, as_declared=False)
        assert [r for r in res.rows if r.local and r.local.get("nmse", 0) > 0] == []
