"""Hostile inputs to `llorch-ref eval`: a text too large, a chunk too large for memory, a Ray address where no
cluster answers, a model name that matplotlib would read as mathtext, a folder given as --text. Each ends in one
`error:` line and exit 2 within seconds, or (the name) in a written report; nothing is left half-written.

The runs that could allocate gigabytes on a regression run in a subprocess under RLIMIT_AS (2 GiB): there an
allocation the refusal should have prevented fails at once instead of taking the machine's memory."""
from __future__ import annotations

import resource
import shutil
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from llorch_ref.errors import ParameterError
from llorch_ref.harness import corpus_eval, ray_eval

TEXT = ("It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of "
        "foolishness, it was the epoch of belief, it was the epoch of incredulity.\n")
MEMORY_CAP = 2 << 30


def run_cli(*args, timeout=60, memory=MEMORY_CAP):
    """llorch-ref in its own process with its address space capped -> (CompletedProcess, seconds)."""
    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "llorch_ref.cli", *map(str, args)], capture_output=True, text=True,
                       timeout=timeout, preexec_fn=cap)
    return r, time.monotonic() - t0


def one_error_line(r, *fragments):
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, (r.returncode, r.stderr[-3000:])
    for f in fragments:
        assert f in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def model(tiny):
    return tiny(weight_type="F32", n_layers=2, vocab="bpe", context_length=256)


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    p = tmp_path_factory.mktemp("corpus") / "tale.txt"
    p.write_text(TEXT * 20, encoding="utf-8")
    return p


def outputs(tmp_path):
    return ["--json", tmp_path / "out.json", "--report", tmp_path / "rep"]


def nothing_written(tmp_path):
    return not (tmp_path / "out.json").exists() and not (tmp_path / "rep").exists() and \
        [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_a_text_over_the_size_limit_is_refused_before_it_is_read(model, tmp_path):
    big = tmp_path / "big.txt"
    with open(big, "wb") as f:                       # 200 MB, sparse: no disk used, every byte valid UTF-8
        f.truncate(200 * 10**6)
    r, dt = run_cli("eval", "--model", model, "--subject", "numpy", "--text", big, "--ctx", 64, "--chunks", 1,
                    *outputs(tmp_path))
    one_error_line(r, f"--text {big}", "200000000 bytes", "64 MiB")
    assert dt < 10 and nothing_written(tmp_path)


def test_only_what_the_chunks_need_is_read(model, tmp_path):
    """A 40 MB text with --chunks 1: the first window is tokenized and nothing after it (an undecodable byte at
    the end is never reached); under 2 GiB of address space, in seconds."""
    p = tmp_path / "long.txt"
    with open(p, "wb") as f:
        f.write((TEXT * (40 * 10**6 // len(TEXT))).encode() + b"\xff")
    r, dt = run_cli("eval", "--model", model, "--subject", "numpy", "--text", p, "--ctx", 64, "--chunks", 1,
                    "--json", tmp_path / "out.json")
    assert r.returncode == 0, r.stderr[-3000:]
    assert dt < 20, dt


@pytest.mark.parametrize("window,overlap", [(300, 64), (1000, 200), (4096, 512)])
@pytest.mark.parametrize("vocab", ["bpe", "spm"])
def test_windowed_tokens_are_the_whole_texts_tokens(tiny, tmp_path, vocab, window, overlap, monkeypatch):
    import llorch_ref
    from llorch_ref.testing.tiny import CORPUS

    tok = llorch_ref.load(tiny(vocab=vocab), weights="lazy").tokenizer
    text = (CORPUS + "  \n\n" + TEXT + "a\u00e9\u65e5\U0001f916 ") * 12
    p = tmp_path / "t.txt"
    p.write_text(text, encoding="utf-8")
    monkeypatch.setattr(corpus_eval, "WINDOW", window)
    monkeypatch.setattr(corpus_eval, "OVERLAP", overlap)
    whole = tok.encode(text)
    assert list(corpus_eval.corpus_ids(p, tok, None)) == whole
    part = list(corpus_eval.corpus_ids(p, tok, 500))
    assert len(part) >= 500 and part == whole[:len(part)]


@pytest.mark.parametrize("make,fragment", [
    (lambda d: d, "is a folder"),
    (lambda d: "/dev/zero", "not a regular file"),
    (lambda d: d / "missing.txt", "no such file"),
    (lambda d: (d / "empty.txt").write_text(" \n") and d / "empty.txt", "holds no text"),
    (lambda d: (d / "bad.txt").write_bytes(b"ok\xff") and d / "bad.txt", "UTF-8"),
])
def test_a_text_that_is_not_a_text_file_is_named(model, tmp_path, make, fragment):
    (tmp_path / "in").mkdir()
    target = make(tmp_path / "in")
    r, dt = run_cli("eval", "--model", model, "--subject", "numpy", "--text", target, "--ctx", 64,
                    *outputs(tmp_path))
    one_error_line(r, fragment)
    assert dt < 10 and nothing_written(tmp_path)


# SmolLM2-135M's shape (the default model), for the memory rule without loading it
SMOLLM2 = SimpleNamespace(n_vocab=49152, d_model=576, n_layers=30, n_heads=9, n_kv_heads=3, head_dim=64, d_ff=1536)


def test_the_memory_estimate_of_the_default_model():
    small = corpus_eval.eval_memory(SMOLLM2, 513 << 20, ctx=512, n_chunks=1, sides=2)
    large = corpus_eval.eval_memory(SMOLLM2, 513 << 20, ctx=8192, n_chunks=1, sides=2)
    assert sum(small.values()) < 2e9 < 8e9 < sum(large.values())
    assert large["attention"] == 4 * 9 * 8192 * 8192 * 4


def test_a_chunk_over_the_memory_limit_is_refused_up_front(monkeypatch):
    monkeypatch.setattr(corpus_eval, "memory_available", lambda: 16 << 30)
    corpus_eval.check_memory(SMOLLM2, 513 << 20, ctx=512, n_chunks=10, sides=2)
    with pytest.raises(ParameterError, match=r"--ctx 8192: .*needs about 1\d\.\d GB.*limit 8\.6 GB"):
        corpus_eval.check_memory(SMOLLM2, 513 << 20, ctx=8192, n_chunks=1, sides=2)


def test_ctx_over_the_memory_limit_through_the_cli(tiny, tmp_path):
    """A model of 8192 positions at --ctx 8192: its attention scores alone are 4 GB; refused before the text is
    read or a model runs (under 2 GiB of address space the run itself would fail at its first layer)."""
    m = tiny(weight_type="F32", n_layers=2, vocab="bpe", context_length=8192)
    p = tmp_path / "long.txt"
    p.write_text(TEXT * 300, encoding="utf-8")
    r, dt = run_cli("eval", "--model", m, "--subject", "numpy", "--text", p, "--ctx", 8192, *outputs(tmp_path))
    one_error_line(r, "--ctx 8192", "needs about", "GB", "limit")
    assert dt < 10 and nothing_written(tmp_path)


@pytest.mark.parametrize("address", ["127.0.0.1:1", "ray://127.0.0.1:1"])
def test_a_ray_address_where_nothing_answers_is_an_error_in_seconds(model, text, tmp_path, address):
    pytest.importorskip("ray", reason="Ray is not installed (pip install 'llorch-ref[ray]')")
    r, dt = run_cli("eval", "--model", model, "--subject", "numpy", "--text", text, "--ctx", 64, "--ray", address,
                    *outputs(tmp_path), timeout=60, memory=8 << 30)
    one_error_line(r, f"--ray {address}: no Ray cluster answers there")
    assert dt < 12 and nothing_written(tmp_path)


def test_a_ray_address_that_is_not_an_address_is_named():
    with pytest.raises(ParameterError, match="host:port"):
        ray_eval.ray_endpoint("nowhere")


def test_a_model_named_like_mathtext_gets_its_report(model, text, tmp_path):
    named = tmp_path / "m$\\foo$.gguf"
    shutil.copy(model, named)
    r, _ = run_cli("eval", "--model", named, "--subject", "numpy", "--text", text, "--ctx", 64,
                   "--report", tmp_path / "rep")
    assert r.returncode == 0, r.stderr[-3000:]
    page = (tmp_path / "rep" / "report.html").read_text()
    assert (tmp_path / "rep" / "kld_by_position.png").stat().st_size > 0 and "m$\\foo$.gguf" in page


def test_plot_titles_and_legends_are_plain_text():
    from llorch_ref.harness import plots

    fig = plots.error_by_layer("$\\foo$ vs $x^$", {"$\\bar$": ([0, 1], [1e-3, 1e-4])}, 1e-2)
    texts = [fig.axes[0].title] + list(fig.axes[0].get_legend().get_texts())
    assert all(not t.get_usetex() and not t.get_parse_math() for t in texts)
    plots.png(fig)


@pytest.fixture()
def listening():
    """listening(reply) -> port of a loopback TCP server that answers every connection with `reply` (None: says
    nothing), for the length of the test."""
    import socket
    import threading

    servers = []

    def make(reply):
        srv = socket.create_server(("127.0.0.1", 0))
        servers.append(srv)

        def serve():
            while True:
                try:
                    c, _ = srv.accept()
                except OSError:
                    return
                if reply is not None:
                    c.sendall(reply)
                servers.append(c)
        threading.Thread(target=serve, daemon=True).start()
        return srv.getsockname()[1]
    yield make
    for s in servers:
        s.close()


@pytest.mark.parametrize("reply,fragment", [(b"HTTP/1.0 400 Bad Request\r\n\r\n", "an HTTP/1 server does"),
                                            (b"SSH-2.0-OpenSSH_9.6\r\n", "does not speak gRPC"),
                                            (None, "no answer within 0.5 s")])
def test_a_port_that_answers_but_is_not_ray_is_named(listening, monkeypatch, reply, fragment):
    monkeypatch.setattr(ray_eval, "PROBE_SECONDS", 0.5)
    port = listening(reply)
    t0 = time.monotonic()
    with pytest.raises(ray_eval.RayEvalError, match="no Ray cluster answers there") as e:
        ray_eval.check_cluster_address(f"127.0.0.1:{port}")
    assert fragment in str(e.value) and time.monotonic() - t0 < 3


def test_an_http2_server_passes_the_probe(listening):
    port = listening(b"\x00\x00\x06\x04\x00\x00\x00\x00\x00\x00\x03\x00\x00\x00\x64")   # SETTINGS, as gRPC sends
    ray_eval.check_cluster_address(f"127.0.0.1:{port}")
    ray_eval.check_cluster_address(f"ray://127.0.0.1:{port}")


PROBE_A_LOCAL_RAY = """
import ray
from llorch_ref.harness.ray_eval import check_cluster_address
ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
try:
    check_cluster_address(ray.get_runtime_context().gcs_address)
    print("answers")
finally:
    ray.shutdown()
"""


def test_a_real_ray_cluster_passes_the_probe():
    """A Ray started by ray.init in its own process (and stopped by it): its GCS address answers the probe, so
    --ray ADDRESS of a real cluster runs."""
    pytest.importorskip("ray", reason="Ray is not installed (pip install 'llorch-ref[ray]')")
    import os
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    r = subprocess.run([sys.executable, "-c", PROBE_A_LOCAL_RAY], capture_output=True, text=True, timeout=120,
                       env=env)
    assert r.stdout.strip() == "answers", r.stderr[-3000:]


def test_scores_in_blocks_are_the_scores_of_all_rows_at_once(monkeypatch):
    """score_chunk's working set is a few blocks of rows; every figure is bit for bit that of one block."""
    import numpy as np

    from llorch_ref.harness import kld

    rng = np.random.default_rng(1)
    q, p = (rng.normal(size=(300, 700)).astype(np.float32) for _ in range(2))
    t = rng.integers(0, 700, 300)
    monkeypatch.setattr(kld, "SCORE_BLOCK_BYTES", 8 * 700 * 7)          # blocks of 7 rows
    small = kld.score_chunk(0, q, p, t)
    monkeypatch.setattr(kld, "SCORE_BLOCK_BYTES", 1 << 40)              # one block
    whole = kld.score_chunk(0, q, p, t)
    assert small.to_json() == whole.to_json()
