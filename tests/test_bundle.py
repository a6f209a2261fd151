"""Proof bundles: one folder per run (report.html, summary.md, junit.xml, result.json, manifest.json with every
file's sha256, a folder per checkpoint, repro/ of the first divergence); atomic writes; never overwriting a run;
`verify` on untouched and edited bundles; the repro failing without the subject engine; the page in a browser."""
from __future__ import annotations

import io
import json
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET

import numpy as np
import pytest

import llorch_ref
from llorch_ref.errors import HarnessError


@pytest.fixture(scope="module")
def tiny_result(tiny, llamacpp):
    from llorch_ref.harness.run import run_diff

    eng = llorch_ref.load(tiny(vocab="bpe"))
    return eng, run_diff(eng, prompt="Once upon a time, there was a little", n_greedy=4)


@pytest.fixture(scope="module")
def planted(tiny, tmp_path_factory):
    """A subject with a 5% scale error in blk.1.ffn_up (its block scales), against the clean file's reference:
    (reference engine, result, bundle folder)."""
    from llorch_ref.checkpoints import engine_band_class
    from llorch_ref.harness.bundle import write_bundle
    from llorch_ref.harness.run import run_subject
    from llorch_ref.references.llorch import record_engine
    from llorch_ref.testing.plant import plant_scale

    q8 = tiny(weight_type="Q8_0", n_layers=3, d_model=128, d_ff=192, vocab="bpe")
    d = tmp_path_factory.mktemp("planted")
    bad = plant_scale(q8, d / "up1x1.05.gguf", "blk.1.ffn_up.weight", 1.05)
    ref = llorch_ref.load(q8)
    ids = ref.tokenizer.encode("Once upon a time, there was")
    sub = record_engine(llorch_ref.load(bad), ids, prompt="Once upon a time, there was", n_greedy=4).to_dump()
    res = run_subject(ref, sub, engine_band_class(ref), subject_label="planted engine")
    out = write_bundle(res, ref, out_dir=d / "pb", run_id="planted", argv=["llorch-ref", "prove", "--subject", "x"])
    return ref, res, out["dir"]


def test_prove_without_plots_writes_the_same_files_less_the_images(tiny, tmp_path, llamacpp):
    """prove --no-plots: no PNG, the page says why there are none, matplotlib never imported; the same checkpoint
    files otherwise, and verify redoes its figures."""
    model = tiny(vocab="bpe")
    runs = {}
    for rid, more in (("plain", []), ("bare", ["--no-plots"])):
        cmd = [sys.executable, "-X", "importtime", "-m", "llorch_ref.cli", "prove", "--model", str(model), "--out",
               str(tmp_path), "--run-id", rid, "--greedy", "2", "--checkpoint", "4", *more]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        runs[rid] = ({p.relative_to(tmp_path / rid).as_posix() for p in (tmp_path / rid).rglob("*") if p.is_file()},
                     "matplotlib" in r.stderr)
    (plain, plt_plain), (bare, plt_bare) = runs["plain"], runs["bare"]
    assert plt_plain and not plt_bare
    assert {f for f in plain if f.endswith(".png")} == {"cp4_attention_scores/error_by_layer.png"}
    assert bare == {f for f in plain if not f.endswith(".png")}
    page = (tmp_path / "bare" / "report.html").read_text()
    assert "Plots not drawn (written with --no-plots)." in page and "<svg" not in page
    r = subprocess.run([sys.executable, "-m", "llorch_ref.cli", "verify", str(tmp_path / "bare")], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0 and "the figures hold" in r.stdout, r.stdout + r.stderr


def test_bundle_layout_and_contents(tiny_result, tmp_path):
    from llorch_ref.harness.bundle import sha256_of, write_bundle

    eng, res = tiny_result
    out = write_bundle(res, eng, out_dir=tmp_path, run_id="r1", argv=["llorch-ref", "prove"])
    run = tmp_path / "r1"
    assert out["dir"] == run and out["repro"] is None                  # nothing diverges: no repro
    assert {"report.html", "summary.md", "junit.xml", "result.json", "manifest.json"} <= {p.name for p in run.iterdir()}
    d = run / "cp4_attention_scores"
    assert sorted(p.name for p in d.iterdir()) == ["error_by_layer.png", "reference.npz", "report.json", "report.md",
                                                   "subject.npz"]
    man = json.loads((run / "manifest.json").read_text())
    for key in ("llorch_ref_version", "git_commit", "numpy", "gguf", "llama_cpp_python", "cpu_model", "cpu_flags",
                "model_sha256", "backend", "prompt", "token_ids", "sides", "recipe", "seed", "command", "files"):
        assert key in man, key
    assert man["recipe"]["kind"] == "llamacpp" and man["recipe"]["token_ids"] == res.token_ids
    files = [p for p in run.rglob("*") if p.is_file() and p.name != "manifest.json"]
    assert len(man["files"]) == len(files) > 60
    assert all(man["files"][p.relative_to(run).as_posix()] == sha256_of(p) for p in files)
    llama = man["sides"]["reference"]["arithmetic"]["settings"]
    assert llama["flash_attn"] is False and llama["type_k"] == "f32"
    ours, ref = np.load(d / "subject.npz"), np.load(d / "reference.npz")
    assert {"cp4.kq.layer0", "cp4.kq_soft_max.layer1"} <= set(ours.files) and set(ours.files) == set(ref.files)
    rep = json.loads((d / "report.json").read_text())
    assert rep["passed"] is True and len(rep["rows"]) == 2 * eng.config.n_layers
    assert {"max_abs", "max_rel", "nmse", "cosine", "band"} <= set(rep["rows"][0])
    assert "Verdict: PASS" in (d / "report.md").read_text() and "`error_by_layer.png`" in (d / "report.md").read_text()
    assert (run / "summary.md").read_text().startswith("# Proof run r1: every checkpoint inside its band")
    suites = ET.parse(run / "junit.xml").getroot()
    assert int(suites.get("tests")) == len(res.rows) + len(res.not_covered) + 1 and suites.get("failures") == "0"
    assert suites.find("testsuite[@name='llorch_verdict']/testcase/system-out") is not None      # PASS: one case more
    assert {c.get("name") for c in suites.iter("testcase")} >= {"cp4.kq L0", "cp6.ffn_swiglu L1"}
    html = (run / "report.html").read_text()
    assert "PASS: every checkpoint inside its band" in html and "<svg" in html
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:|//)""", html)          # self-contained: loads nothing
    assert not [p for p in tmp_path.iterdir() if p.name != "r1"]                               # no staging left


def test_greedy_row_says_what_it_measures(tiny_result, tmp_path):
    from llorch_ref.harness.bundle import write_bundle

    eng, res = tiny_result
    write_bundle(res, eng, out_dir=tmp_path, run_id="g")
    text = (tmp_path / "g" / "cp12_greedy_text" / "report.md").read_text()
    row = next(line for line in text.splitlines() if "| greedy_tokens |" in line)
    n = res.greedy["n"]
    assert f"{res.greedy['equal_prefix']}/{n} tokens equal" in row and "cosine" not in row


def test_existing_run_id_is_never_overwritten(tiny_result, tmp_path):
    from llorch_ref.harness.bundle import write_bundle

    eng, res = tiny_result
    write_bundle(res, eng, out_dir=tmp_path, run_id="same")
    before = (tmp_path / "same" / "cp1_rms_norm" / "report.json").read_bytes()
    with pytest.raises(HarnessError, match="already exists"):
        write_bundle(res, eng, out_dir=tmp_path, run_id="same")
    assert (tmp_path / "same" / "cp1_rms_norm" / "report.json").read_bytes() == before


def test_interrupted_write_leaves_nothing(tiny_result, tmp_path, monkeypatch):
    from llorch_ref.harness import bundle

    eng, res = tiny_result
    calls = {"n": 0}
    orig = bundle.write_npz

    def failing(*a, **k):
        calls["n"] += 1
        if calls["n"] == 7:
            raise KeyboardInterrupt("simulated interrupt while writing")
        return orig(*a, **k)
    monkeypatch.setattr(bundle, "write_npz", failing)             # the writer of each checkpoint's tensors
    with pytest.raises(KeyboardInterrupt):
        bundle.write_bundle(res, eng, out_dir=tmp_path, run_id="cut")
    assert list(tmp_path.iterdir()) == []                       # no run folder, no staging folder
    monkeypatch.setattr(bundle, "write_npz", orig)
    assert bundle.write_bundle(res, eng, out_dir=tmp_path, run_id="cut")["dir"].is_dir()   # rerun works


def test_run_id_dir_and_ci_summary_from_environment(tiny_result, tmp_path, monkeypatch):
    from llorch_ref.harness.bundle import write_bundle

    eng, res = tiny_result
    step = tmp_path / "step_summary.md"
    step.write_text("earlier step\n")
    monkeypatch.setenv("LLORCH_RUN_ID", "from-env")
    monkeypatch.setenv("LLORCH_PROOF_DIR", str(tmp_path / "pb"))
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(step))
    out = write_bundle(res, eng)
    assert out["dir"] == tmp_path / "pb" / "from-env"
    text = step.read_text()
    assert text.startswith("earlier step\n# Proof run from-env:") and "| 6 | swiglu |" in text   # appended, no links


def test_planted_bug_is_named_on_every_face(planted):
    _, res, run = planted
    fd = res.first_divergence
    assert (fd["checkpoint"], fd["layer"], fd["tensor"], fd["by"]) == ("6", 1, "ffn_swiglu", "local error")
    assert (run / "summary.md").read_text().startswith(
        "# Proof run planted: DIVERGED at checkpoint 6, layer 1, ffn_swiglu, by local error")
    html = (run / "report.html").read_text()
    first_screen = html[html.index("<main>"):html.index("<h2>Checkpoints")]
    assert "DIVERGED: checkpoint 6, ffn_swiglu, layer 1 (by local error)" in first_screen
    assert "data:image/png;base64," in first_screen and "worst indices" in first_screen   # heat map, worst indices
    failures = [c for c in ET.parse(run / "junit.xml").getroot().iter("testcase") if c.find("failure") is not None]
    assert [c.get("name") for c in failures] == ["cp6.ffn_swiglu L1", "verdict"]        # the row and the verdict
    assert "local (the reference's operation on the subject's inputs): NMSE" in failures[0].find("failure").get("message")


def test_repro_fails_with_the_same_figures_without_the_subject_engine(planted):
    from llorch_ref.harness.metrics import fmt

    _, res, run = planted
    row = next(r for r in res.rows if r.diverges)
    case = json.loads((run / "repro" / "case.json").read_text())
    assert case["tensor"] == "ffn_swiglu" and case["inputs"] == ["ffn_norm.layer1"]
    assert sorted(case["weights"]) == ["w_down", "w_gate", "w_up"]
    # the subject engine (here llorch-ref on the planted file; in general llama.cpp, torch) cannot be imported
    block = ("import sys; [sys.modules.__setitem__(m, None) for m in ('llama_cpp', 'torch', 'transformers')]; "
             "import pytest; sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', sys.argv[1]]))")
    r = subprocess.run([sys.executable, "-c", block, str(run / "repro")], capture_output=True, text=True,
                       timeout=300, cwd=run)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "1 failed, 1 passed" in r.stdout                          # the reference op reproduces; the subject fails
    assert f"local NMSE {fmt(row.local['nmse'])}, max abs {fmt(row.local['max_abs'])}" in r.stdout


def test_verify_passes_untouched_and_names_an_edited_file(planted, tmp_path, capsys):
    from llorch_ref.cli import main
    from llorch_ref.harness.verify import verify_bundle

    _, _, run = planted
    v = verify_bundle(run)
    assert v.ok and v.rerun["reference_bit_equal"] == v.rerun["reference_tensors"] > 50
    assert v.rerun["figures_hold"] and not v.rerun["verdicts_changed"]
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    rep = copy / "cp6_swiglu" / "report.md"
    rep.write_text(rep.read_text().replace("**Verdict: FAIL**", "**Verdict: PASS**"))
    (copy / "cp7_block" / "reference.npz").unlink()
    (copy / "notes.txt").write_text("added later")
    assert main(["verify", str(copy), "--no-rerun"]) == 1
    out = capsys.readouterr().out
    assert "EDITED after the run: cp6_swiglu/report.md" in out and "MISSING: cp7_block/reference.npz" in out
    assert "ADDED after the run: notes.txt" in out and "verify: FAILED" in out


def test_verify_reruns_and_finds_figures_that_no_longer_hold(planted, tmp_path):
    """A forger who edits result.json and re-hashes the manifest passes the hash check, not the re-run."""
    from llorch_ref.harness.bundle import file_hashes
    from llorch_ref.harness.verify import verify_bundle

    _, _, run = planted
    copy = tmp_path / "forged"
    shutil.copytree(run, copy)
    res = json.loads((copy / "result.json").read_text())
    for r in res["rows"]:
        if r.get("local_passed") is False:
            r["local_passed"] = True
    res["first_divergence"] = None
    (copy / "result.json").write_text(json.dumps(res))
    man = json.loads((copy / "manifest.json").read_text())
    man["files"] = file_hashes(copy)
    (copy / "manifest.json").write_text(json.dumps(man))
    v = verify_bundle(copy)
    assert v.files_ok and not v.ok
    assert v.rerun["verdicts_changed"] == ["cp6 ffn_swiglu L1: passes in the bundle, diverges now"]


def test_verify_refuses_what_is_not_a_bundle(tmp_path, capsys):
    from llorch_ref.cli import main

    assert main(["verify", str(tmp_path)]) == 2
    assert "no manifest.json: not a proof bundle" in capsys.readouterr().err


def test_terminal_table_fits_100_columns_in_a_file(tiny_result):
    from llorch_ref.cli.report import print_result

    _, res = tiny_result
    buf = io.StringIO()
    print_result(res, True, file=buf)
    lines = buf.getvalue().splitlines()
    assert len(lines) > 20 and max(len(line) for line in lines) <= 100
    for s in res.summary():                             # one row a line: no checkpoint's name folded
        assert any(f" {s['name']} " in line for line in lines), s["name"]


def test_a_narrow_console_folds_names_never_figures():
    from rich.console import Console

    from llorch_ref.cli.report import _table

    t = _table("t", ["cp", "name", "n", "failed", "worst NMSE", "max abs", "cosine / tokens", "worst at", "band",
                     "verdict"])
    t.add_row("4", "attention_scores", "60", "0", "0.00252046", "11.8608", "1-1.25e-03", "L13 kq", "nmse<=0.022",
              "pass")
    buf = io.StringIO()
    Console(file=buf, width=90).print(t)
    for cell in ("0.00252046", "1-1.25e-03", "nmse<=0.022", "verdict"):
        assert cell in buf.getvalue(), cell


def test_report_renders_in_headless_chromium(planted, tmp_path):
    from llorch_ref.testing.browser import chromium, render

    if chromium() is None:
        pytest.skip("no chromium on PATH (Debian package chromium): the page is not opened in a browser here")
    bad = tmp_path / "bad.html"
    bad.write_text("<html><body><p>x</p><script>undefined_function()</script></body></html>")
    assert any("undefined_function" in line for line in render(bad)["console"])       # the check can fail
    _, _, run = planted
    shot = tmp_path / "first_screen.png"
    page = render(run / "report.html", screenshot=shot)
    assert page["console"] == []
    assert "DIVERGED: checkpoint 6, ffn_swiglu, layer 1" in page["dom"] and page["dom"].count("<svg") >= 8
    assert shot.stat().st_size > 20000


def test_backend_run_records_numba_and_verifies(tiny, tmp_path):
    """A numba-against-numpy run: the manifest names numba's version; verify re-runs the numpy oracle under the
    backend's band and the figures hold."""
    from importlib.metadata import version

    from llorch_ref.harness.bundle import write_bundle
    from llorch_ref.harness.run import run_backend_diff
    from llorch_ref.harness.verify import verify_bundle

    pytest.importorskip("numba")
    model = tiny(vocab="bpe", n_layers=2)
    eng = llorch_ref.load(model, backend="numba")
    res = run_backend_diff(eng, llorch_ref.load(model, backend="numpy"), n_greedy=4)
    run = write_bundle(res, eng, out_dir=tmp_path, run_id="numba")["dir"]
    man = json.loads((run / "manifest.json").read_text())
    assert man["numba"] == version("numba") and man["backend"] == "numba" and "cupy" not in man
    assert man["recipe"]["kind"] == "llorch" and man["recipe"]["backend_band"]
    v = verify_bundle(run)
    assert v.ok and v.rerun["figures_hold"] and v.rerun["comparisons"] == len(res.rows)


def test_transformers_run_verifies(tiny, tmp_path):
    """A --reference transformers run keeps a recipe too: verify re-runs transformers and the figures hold."""
    pytest.importorskip("transformers", reason="the hf extra is not installed")
    from llorch_ref.cli import main
    from llorch_ref.harness.verify import verify_bundle

    model = tiny(vocab="bpe", n_layers=2)
    assert main(["prove", "--reference", "transformers", "--model", str(model), "--greedy", "4", "--out",
                 str(tmp_path), "--run-id", "t"]) == 0
    man = json.loads((tmp_path / "t" / "manifest.json").read_text())
    assert man["recipe"]["kind"] == "transformers"
    v = verify_bundle(tmp_path / "t")
    assert v.ok and v.rerun["figures_hold"] and v.rerun["reference_bit_equal"] == v.rerun["reference_tensors"]
