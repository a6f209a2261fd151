"""llorch-ref eval: the statistics against hand-computed and numpy figures, the chunks as llama-perplexity cuts
them, subjects (an engine, another file, dumps) through the CLI, bad input as one-line errors, and Ray: a
local Ray equal to the in-process run bit for bit, and a two-node cluster with a worker killed mid-run."""
from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest

import llorch_ref
from llorch_ref.errors import ParameterError
from llorch_ref.harness.corpus_eval import make_chunks, run_eval
from llorch_ref.harness.kld import score_chunk, summary
from llorch_ref.references.logit_sources import SourceSpec

TEXT = ("It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of "
        "foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the season of Light, "
        "it was the season of Darkness, it was the spring of hope, it was the winter of despair. ") * 6


def test_kld_and_delta_p_on_a_hand_computed_case():
    p, q = np.log([[0.5, 0.5]]), np.log([[0.9, 0.1]])          # reference p, subject q; the next token is 1
    s = score_chunk(0, q, p, [1])
    assert s.kld[0] == pytest.approx(0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1), rel=1e-12)
    assert s.nll[0] == pytest.approx(-math.log(0.1)) and s.nll_base[0] == pytest.approx(-math.log(0.5))
    assert s.p_diff[0] == pytest.approx(0.1 - 0.5) and s.same_top[0]      # the tie in p goes to token 0, as q
    same = score_chunk(0, p, p, [1])
    assert same.kld[0] == 0.0 and same.same_top[0]


def test_top_k_membership_matches_a_stable_sort_with_ties():
    rng = np.random.default_rng(3)
    sub = rng.integers(0, 4, size=(400, 16)).astype(np.float64)        # few distinct values: ties everywhere
    ref = rng.normal(size=sub.shape)
    s = score_chunk(0, sub, ref, rng.integers(0, 16, 400))
    order = np.argsort(-sub, axis=-1, kind="stable")                    # the subject's ranking, ties by index
    ref_top = ref.argmax(-1)
    for k in (1, 5, 10):
        want = (order[:, :k] == ref_top[:, None]).any(-1)
        assert np.array_equal(s.ref_top_in[k], want), k


def test_summary_matches_numpy_percentiles_and_standard_errors():
    rng = np.random.default_rng(0)
    ref = rng.normal(size=(300, 50))
    sub = ref + rng.normal(scale=0.3, size=ref.shape)
    s = score_chunk(0, sub, ref, rng.integers(0, 50, 300))
    out = summary([s])
    k = s.kld
    assert out["Mean KLD"][0] == pytest.approx(k.mean(), rel=1e-12)
    assert out["Mean KLD"][1] == pytest.approx(k.std() / math.sqrt(len(k) - 1), rel=1e-9)
    for name, f in (("99.0%", 0.99), ("90.0%", 0.9), ("10.0%", 0.1)):
        assert out[f"{name} KLD"] == pytest.approx(np.percentile(k, 100 * f), rel=1e-9)
    assert out["Median KLD"] == pytest.approx(np.median(k)) and out["Maximum KLD"] == k.max()
    assert out["Mean PPL(Q)"][0] == pytest.approx(math.exp(s.nll.mean()))
    assert out["Mean PPL(Q)/PPL(base)"][0] == pytest.approx(math.exp(s.nll.mean() - s.nll_base.mean()))
    assert out["Cor(ln(PPL(Q)), ln(PPL(base)))"] == pytest.approx(np.corrcoef(s.nll, s.nll_base)[0, 1], rel=1e-2)
    assert out["RMS Δp"][0] == pytest.approx(math.sqrt((s.p_diff ** 2).mean()))
    assert out["Same top p"][0] == pytest.approx(s.same_top.mean())


def test_chunks_are_cut_as_llama_perplexity_cuts_them():
    ids = list(range(100, 1100))
    c = make_chunks(ids, 128, None, 1)
    assert len(c) == 7 and all(len(x) == 128 and x[0] == 1 for x in c) and c[1][1:] == ids[129:256]
    assert make_chunks(ids, 128, 2, None)[1] == ids[128:256]
    for bad in [dict(ctx=2000, n_chunks=None), dict(ctx=128, n_chunks=8), dict(ctx=8, n_chunks=None)]:
        with pytest.raises(ParameterError):
            make_chunks(ids, bad["ctx"], bad["n_chunks"], 1)


@pytest.fixture(scope="module")
def models(tiny):
    return tiny(weight_type="F32", n_layers=2, vocab="bpe", context_length=256), \
        tiny(weight_type="Q8_0", n_layers=2, vocab="bpe", context_length=256)


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    p = tmp_path_factory.mktemp("corpus") / "tale.txt"
    p.write_text(TEXT, encoding="utf-8")
    return p


def cli(*a, timeout=600):
    return subprocess.run([sys.executable, "-m", "llorch_ref.cli", *map(str, a)], capture_output=True, text=True,
                          timeout=timeout)


def test_eval_cli_an_engine_against_itself_and_against_a_quantized_copy(models, text, tmp_path):
    f32, q8 = models
    r = cli("eval", "--model", f32, "--subject", "numpy", "--text", text, "--ctx", 64, "--json", tmp_path / "a.json")
    assert r.returncode == 0, r.stderr
    same = json.loads((tmp_path / "a.json").read_text())["statistics"]
    assert same["Mean KLD"] == [0.0, 0.0] and same["Same top p"][0] == 1.0 and same["Maximum KLD"] == 0.0
    assert "Mean PPL(Q)/PPL(base)" in r.stdout and "Same top p" in r.stdout
    r = cli("eval", "--model", f32, "--subject", "numpy", "--subject-model", q8, "--text", text, "--ctx", 64,
            "--json", tmp_path / "b.json", "--report", tmp_path / "rep")
    assert r.returncode == 0, r.stderr
    other = json.loads((tmp_path / "b.json").read_text())
    assert other["statistics"]["Mean KLD"][0] > 0 and len(other["kld_by_position"]) == 64 - 1 - 32
    assert (tmp_path / "rep" / "report.md").is_file() and (tmp_path / "rep" / "kld_histogram.png").stat().st_size > 0
    page = (tmp_path / "rep" / "report.html").read_text()
    assert "Mean KLD" in page and page.count("<svg") == 2 and "`kld_histogram.png`" in (tmp_path / "rep" / "report.md").read_text()


def test_eval_cli_bad_input_is_one_line(models, text, tmp_path):
    f32, _ = models
    for args, msg in [(("--subject", "numpy", "--flash-attn"), "not a setting of --subject numpy"),
                      (("--subject", "nothing-here"), "neither one of"),
                      (("--subject", "numpy", "--chunks", "999"), "chunks of 64 tokens"),
                      (("--subject", "numpy", "--text", tmp_path / "missing.txt"), "no such file")]:
        a = list(args) if "--text" in args else list(args) + ["--text", text]
        r = cli("eval", "--model", f32, "--ctx", 64, *a)
        assert r.returncode != 0 and msg in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_dumps_written_per_chunk_are_a_subject(models, text, tmp_path):
    from llorch_ref.references.llorch import record_engine
    f32, q8 = models
    eng = llorch_ref.load(q8)
    chunks = make_chunks(eng.tokenizer.encode(TEXT), 64, None, eng.tokenizer.bos_id)
    d = tmp_path / "dumps"
    d.mkdir()
    for i, c in enumerate(chunks):
        record_engine(eng, c, n_greedy=0, rows=range(32, 63)).save(d / f"chunk{i}.safetensors")
    from_dumps = run_eval(SourceSpec("dump", str(d)), SourceSpec("numpy", str(f32)), chunks, "t")
    direct = run_eval(SourceSpec("numpy", str(q8)), SourceSpec("numpy", str(f32)), chunks, "t")
    a, b = from_dumps.to_json()["statistics"], direct.to_json()["statistics"]
    assert a["Mean KLD"][0] == pytest.approx(b["Mean KLD"][0], rel=1e-5) and a["Mean KLD"][0] > 0


@pytest.fixture
def ray():
    return pytest.importorskip("ray", reason="Ray is not installed (pip install 'llorch-ref[ray]')")


def test_a_local_ray_gives_the_in_process_scores_bit_for_bit(ray, models, text, tmp_path):
    """Through the CLI, as a user runs it (its own process: one Ray session per process)."""
    f32, q8 = models
    args = ("eval", "--model", f32, "--subject", "numpy", "--subject-model", q8, "--text", text, "--ctx", 64)
    r1, r2 = cli(*args, "--json", tmp_path / "here.json"), cli(*args, "--ray", "--json", tmp_path / "ray.json")
    assert r1.returncode == 0 and r2.returncode == 0, r1.stderr[-1500:] + r2.stderr[-1500:]
    here, there = (json.loads((tmp_path / f).read_text()) for f in ("here.json", "ray.json"))
    assert there["where"].startswith("ray: ") and there["timings"]["chunks_rerun"] == 0
    assert here["statistics"] == there["statistics"] and here["kld_values"] == there["kld_values"]


@pytest.fixture
def two_node_cluster(ray, monkeypatch):
    """A head and a worker node on loopback (ray start), each with one CPU; stopped afterwards. Token
    authentication off for this loopback cluster (the driver too), as Ray >= 2.5x enables it by default."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}
    temp = tempfile.mkdtemp(prefix="ray", dir="/tmp")       # short: Ray's socket paths must fit in 107 bytes
    ray_cli = os.path.join(os.path.dirname(sys.executable), "ray")   # the interpreter's own, on PATH or not
    run = lambda *a: subprocess.run([ray_cli, "start", *a], env=env, capture_output=True, text=True, timeout=120)
    head = run("--head", f"--port={port}", "--num-cpus=1", "--include-dashboard=false", f"--temp-dir={temp}",
               "--node-ip-address=127.0.0.1")
    assert head.returncode == 0, head.stderr[-2000:]
    worker = run(f"--address=127.0.0.1:{port}", "--num-cpus=1", "--node-ip-address=127.0.0.1")
    try:
        assert worker.returncode == 0, worker.stderr[-2000:]
        yield f"127.0.0.1:{port}"
    finally:
        subprocess.run([ray_cli, "stop", "--force"], env=env, capture_output=True, timeout=120)
        shutil.rmtree(temp, ignore_errors=True)


def test_a_worker_killed_mid_run_has_its_chunk_rerun_and_every_chunk_counted_once(models, two_node_cluster):
    from llorch_ref.harness.ray_eval import run_eval_ray
    f32, q8 = models
    eng = llorch_ref.load(f32)
    chunks = make_chunks(eng.tokenizer.encode(TEXT * 4), 64, None, eng.tokenizer.bos_id)
    sub, ref = SourceSpec("numpy", str(q8)), SourceSpec("numpy", str(f32))
    here = run_eval(sub, ref, chunks, "t").to_json()
    killed = []

    def kill_one_scorer(n):                       # after the first chunk: SIGKILL one actor's process
        if killed:
            return
        import psutil
        for p in psutil.process_iter(["cmdline"]):
            if any("ray::Scorer" in c for c in (p.info["cmdline"] or [])):
                os.kill(p.pid, signal.SIGKILL)
                killed.append(p.pid)
                time.sleep(0.5)
                return
    there = run_eval_ray(sub, ref, chunks, "t", address=two_node_cluster, progress=kill_one_scorer)
    out = there.to_json()
    assert killed and out["timings"]["nodes"] == 2 and out["timings"]["chunks_rerun"] >= 1, out["timings"]
    assert [c["index"] for c in out["per_chunk"]] == list(range(len(chunks)))
    assert out["statistics"] == here["statistics"] and out["kld_values"] == here["kld_values"]
