"""The faces around the black-box comparison: `prove --subject openai:URL|mistralrs` (a bundle with the per-step
table and the engine's trace, `verify` accepting it and failing a forged one), `eval --subject ...` (corpus
statistics through what the engine offers, with the method and its cost said) and the pytest plugin, each against
llama-cpp-python's own server on 127.0.0.1 (and mistral.rs where installed), on a clean and a planted file."""
from __future__ import annotations

import hashlib
import json
import shutil

import numpy as np
import pytest
from blackbox_helpers import PROMPT, needs_mistralrs, needs_server

from llorch_ref.cli import main


@pytest.fixture(scope="module")
def model(blackbox_self_run):
    return blackbox_self_run[0].path


@pytest.fixture(scope="module")
def clean_url(llama_cpp_clean_url):
    return llama_cpp_clean_url


@pytest.fixture(scope="module")
def planted_url(llama_cpp_planted_url):
    return llama_cpp_planted_url


def prove(capsys, tmp_path, subject, run_id, *extra, steps=6):
    rc = main(["prove", "--threads", "1", "--subject", subject, "--prompt", PROMPT, "--decode-steps", str(steps),
               "--out", str(tmp_path), "--run-id", run_id, "--no-plots", *extra])
    capsys.readouterr()
    return rc, tmp_path / run_id


def verify(capsys, folder, *extra):
    rc = main(["verify", str(folder), "--json", *extra])
    return rc, json.loads(capsys.readouterr().out)


def rehash(folder, name):
    """A forger's edit made to look written: the file's sha256 put in the manifest again."""
    man = json.loads((folder / "manifest.json").read_text())
    man["files"][name] = hashlib.sha256((folder / name).read_bytes()).hexdigest()
    (folder / "manifest.json").write_text(json.dumps(man, indent=2) + "\n")


# -- prove and verify -----------------------------------------------------------------------------------------
@needs_server
def test_prove_a_clean_server_writes_the_steps_and_verify_accepts_it(clean_url, tmp_path, capsys):
    rc, run = prove(capsys, tmp_path, f"openai:{clean_url}", "clean")
    assert rc == 0
    for name in ("report.html", "junit.xml", "summary.md", "steps.md", "trace.json", "trace.npz", "result.json"):
        assert (run / name).is_file(), name
    stored = json.loads((run / "result.json").read_text())
    steps = stored["blackbox"]["steps"]
    assert [s["step"] for s in steps] == list(range(6)) and all(s["passed"] for s in steps)
    assert stored["blackbox"]["divergence"] is None
    assert "| 5 |" in (run / "steps.md").read_text() and "steps.md" in (run / "summary.md").read_text()
    assert json.loads((run / "manifest.json").read_text())["recipe"]["kind"] == "blackbox"
    rc, v = verify(capsys, run)
    assert rc == 0 and v["ok"] and v["rerun"]["figures_hold"], v
    assert v["rerun"]["comparisons"] == len(stored["rows"])


@pytest.fixture(scope="module")
def planted_bundle(planted_url, tmp_path_factory):
    """prove of the planted server, once: -> (exit code, its run folder)."""
    out = tmp_path_factory.mktemp("planted-bundle")
    rc = main(["prove", "--threads", "1", "--subject", f"openai:{planted_url}", "--prompt", PROMPT, "--decode-steps",
               "6", "--out", str(out), "--run-id", "planted", "--no-plots"])
    return rc, out / "planted"


@needs_server
def test_prove_a_planted_server_names_the_divergence_with_both_distributions(planted_bundle, capsys):
    rc, run = planted_bundle
    assert rc == 1
    stored = json.loads((run / "result.json").read_text())
    at = stored["blackbox"]["divergence"]
    fd = stored["verdict"]["first_divergence"]
    assert at["step"] == fd["step"] and len(at["top_reference"]) == 5 and len(at["top_engine"]) == 5
    steps_md = (run / "steps.md").read_text()
    assert "First divergence:" in steps_md and "| rank | reference | p | engine | p |" in steps_md
    junit = (run / "junit.xml").read_text()
    assert 'failures="0"' not in junit.split("\n", 2)[1]
    rc, v = verify(capsys, run)                       # a FAIL bundle, written as it ran: verify accepts it
    assert rc == 0 and v["ok"] and v["verdict"]["status"] == "FAIL", v


@needs_server
def test_verify_fails_a_forged_bundle(planted_bundle, tmp_path, capsys):
    _, run = planted_bundle
    forged = tmp_path / "kld"                  # one step's KLD lowered inside its band, the hash recomputed
    shutil.copytree(run, forged)
    stored = json.loads((forged / "result.json").read_text())
    row = next(r for r in stored["rows"] if r["checkpoint"] == "11" and r["passed"])
    row["kld"] = row["kld"] / 2 + 1e-3
    (forged / "result.json").write_text(json.dumps(stored, indent=2) + "\n")
    rehash(forged, "result.json")
    rc, v = verify(capsys, forged)
    assert rc == 1 and not v["ok"] and any("kld" in c for c in v["rerun"]["verdicts_changed"]), v

    forged = tmp_path / "trace"                # the engine's answer made the reference's own, the hash recomputed
    shutil.copytree(run, forged)
    with np.load(forged / "trace.npz") as z:
        a = {k: z[k] for k in z.files}
    a["top_logprobs"] = a["top_logprobs"] - 0.5
    np.savez_compressed(forged / "trace.npz", **a)
    rehash(forged, "trace.npz")
    rc, v = verify(capsys, forged)
    assert rc == 1 and not v["rerun"]["figures_hold"], v

    forged = tmp_path / "steps"                # the step table edited, the hash not
    shutil.copytree(run, forged)
    (forged / "steps.md").write_text((forged / "steps.md").read_text().replace("**FAIL**", "pass"))
    rc, v = verify(capsys, forged, "--no-rerun")
    assert rc == 1 and v["edited"] == ["steps.md"], v


@needs_mistralrs
def test_prove_mistralrs_keeps_the_whole_vocabulary_and_verifies(tmp_path, capsys):
    rc, run = prove(capsys, tmp_path, "mistralrs", "mrs", steps=3)
    stored = json.loads((run / "result.json").read_text())
    assert rc == 0, stored["verdict"]
    assert {s["kld_kind"] for s in stored["blackbox"]["steps"]} == {"exact"}
    rc, v = verify(capsys, run)
    assert rc == 0 and v["ok"], v


# -- eval ---------------------------------------------------------------------------------------------------
def eval_json(capsys, tmp_path, subject, *extra):
    tmp_path.mkdir(exist_ok=True)
    out = tmp_path / "eval.json"
    rc = main(["eval", "--subject", subject, "--ctx", "16", "--chunks", "1", "--threads", "1", "--json", str(out),
               *extra])
    text = capsys.readouterr().out
    return rc, json.loads(out.read_text()), text


@needs_server
def test_eval_through_llama_cpp_servers_echo_says_its_method_and_cost(clean_url, planted_url, tmp_path, capsys):
    rc, clean, text = eval_json(capsys, tmp_path / "c", f"openai:{clean_url}")
    how = clean["blackbox"]
    assert rc == 0 and how["method"] == "echo" and how["requests"] == 1 and how["positions"] == 7
    assert how["engine_s"] > 0 and "lower bound" in how["kld"] and "method: echo" in text
    assert clean["statistics"]["scored tokens"] == 7
    rc, bad, _ = eval_json(capsys, tmp_path / "p", f"openai:{planted_url}")
    assert bad["statistics"]["Mean KLD"][0] > 10 * clean["statistics"]["Mean KLD"][0]


@needs_mistralrs
def test_eval_mistralrs_asks_one_token_a_position(tmp_path, capsys):
    rc, out, text = eval_json(capsys, tmp_path, "mistralrs", "--top-logprobs", "200")
    how = out["blackbox"]
    assert rc == 0 and how["method"] == "prefix" and how["top_k"] == 200 and "lower bound" in how["kld"]
    assert how["requests"] == how["positions"] == 7 and how["chunks_dropped"] == 0
    assert "one-token requests" in text


def test_eval_refuses_settings_a_black_box_does_not_have(capsys):
    rc = main(["eval", "--subject", "openai:http://127.0.0.1:9", "--subject-model", "x.gguf"])
    err = capsys.readouterr().err
    assert rc == 2 and "not a setting of a black-box --subject" in err
    rc = main(["eval", "--subject", "numpy", "--top-logprobs", "5"])
    assert rc == 2 and "--top-logprobs" in capsys.readouterr().err


def test_eval_of_a_server_that_is_not_there_is_one_error_line(capsys):
    from llorch_ref.testing.openai_server import free_port

    rc = main(["eval", "--subject", f"openai:http://127.0.0.1:{free_port()}", "--ctx", "16", "--chunks", "1",
               "--timeout", "2"])
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error:")]
    assert rc == 2 and len(err) == 1 and "refused" in err[0], err


# -- the pytest plugin ----------------------------------------------------------------------------------------
def pytest_in(project, *args):
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
                           *args], cwd=project, capture_output=True, text=True, env=env, timeout=600)


@needs_server
def test_the_plugin_renders_a_black_boxs_verdict(clean_url, planted_url, tmp_path):
    import re

    r = pytest_in(tmp_path, f"--llorch-subject=openai:{clean_url}", "--llorch-decode-steps=4",
                  f"--llorch-prompt={PROMPT}", "-vv", f"--llorch-bundle-dir={tmp_path / 'b'}")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    for name in ("verdict", "cp0_tokenizer", "cp10_greedy_argmax", "cp11_softmax_probs"):
        assert re.search(rf"llorch::{name} +PASSED", r.stdout), r.stdout[-3000:]
    assert "cp2_qkv" not in r.stdout and "verdict: PASS" in r.stdout
    assert len(list((tmp_path / "b").glob("*/steps.md"))) == 1
    r = pytest_in(tmp_path, f"--llorch-subject=openai:{planted_url}", "--llorch-decode-steps=6",
                  f"--llorch-prompt={PROMPT}", "-vv")
    assert r.returncode == 1 and "verdict: FAIL" in r.stdout, r.stdout[-3000:]
    assert re.search(r"llorch::verdict +FAILED", r.stdout) and "reference top:" in r.stdout, r.stdout[-3000:]


def test_the_plugin_refuses_a_black_box_it_cannot_reach(tmp_path):
    from llorch_ref.testing.openai_server import free_port

    r = pytest_in(tmp_path, f"--llorch-subject=openai:http://127.0.0.1:{free_port()}", "--llorch-timeout=2")
    assert r.returncode != 0 and "llorch:" in r.stderr and "refused" in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr


def test_a_bundle_of_a_full_length_run_verifies_with_its_run_level_row(blackbox_self_run, tmp_path):
    """The reference as its own black box over 32 steps (the run-level row of cp11 joins the per-step rows): the
    bundle's trace is read back step for step and verify passes it; one step's logprob edited fails it."""
    from llorch_ref.harness.blackbox import RUN, compare_trace
    from llorch_ref.harness.bundle import write_bundle
    from llorch_ref.harness.verify import verify_bundle
    from llorch_ref.references.blackbox import Step, Trace

    eng, ids, gen, logp = blackbox_self_run            # the session's greedy run of 32 steps (SELF_STEPS)
    assert len(gen) == 32
    steps = [Step(token=int(t), logprob=float(logp[j, t]),
                  top={int(i): float(logp[j, i]) for i in np.argsort(-logp[j])[:20]}) for j, t in enumerate(gen)]
    trace = Trace(engine="openai", version="self", prompt=PROMPT, steps=steps, top_k=20, whole=False,
                  prompt_ids=ids, tokenized_by="the reference")
    res = compare_trace(eng, trace)
    assert any(r.tensor == RUN for r in res.rows)
    run = write_bundle(res, eng, out_dir=tmp_path, run_id="full", plot=False, trace=trace)["dir"]
    v = verify_bundle(run)
    assert v.ok and v.rerun["figures_hold"], v.to_json()
    with np.load(run / "trace.npz") as z:
        a = {k: z[k] for k in z.files}
    a["logprob"][3] -= 0.25
    np.savez_compressed(run / "trace.npz", **a)
    rehash(run, "trace.npz")
    v = verify_bundle(run)
    assert not v.ok and any("engine_logprob" in c for c in v.rerun["verdicts_changed"]), v.to_json()
