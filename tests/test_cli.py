"""The command line as a user runs it: streamed output, one-line errors, exit codes."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest


def run(*args, env=None):
    e = dict(os.environ, **(env or {}))
    return subprocess.run([sys.executable, "-m", "llorch_ref.cli", *map(str, args)], capture_output=True,
                          text=True, env=e, timeout=600)


def assert_one_line_error(r, *fragments):
    assert r.returncode == 2, r
    assert "Traceback" not in r.stderr, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, r.stderr
    for f in fragments:
        assert f in lines[0], lines[0]


def test_generate_streams_only_the_continuation(tiny):
    path = tiny(vocab="bpe")
    r = run("generate", "Once upon", "--model", path, "--max-tokens", "5", "--ignore-eos")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() != "" and "loaded" not in r.stdout
    assert "loaded" in r.stderr and "stop: max_tokens" in r.stderr


def test_numba_says_when_no_matrix_has_a_kernel(tiny):
    """F32 weights: every product goes to BLAS on the numba backend; the user is told, and sees the kernel
    blocks on a quantized file instead."""
    pytest.importorskip("numba", reason="numba is not installed")
    r = run("generate", "Once upon", "--model", tiny(vocab="bpe"), "--backend", "numba", "--max-tokens", "2")
    assert r.returncode == 0, r.stderr
    assert "note: no matrix of this model has a numba kernel" in r.stderr and "--backend numpy" in r.stderr
    assert "Q5_K" in r.stderr and "Q2_K" in r.stderr             # every type with a kernel named
    r = run("generate", "Once upon", "--model", tiny(vocab="bpe", weight_type="Q8_0"), "--backend", "numba",
            "--max-tokens", "2")
    assert r.returncode == 0, r.stderr
    assert "note: no matrix" not in r.stderr and "kernel blocks" in r.stderr


def test_numba_says_when_it_compiles_its_kernels(tiny, tmp_path):
    """A first run (numba's cache empty: NUMBA_CACHE_DIR a fresh folder) compiles the kernels, seconds that a user
    would otherwise take for a hang: the load says so, once; the next run loads them from the cache and says
    nothing."""
    pytest.importorskip("numba", reason="numba is not installed")
    env = {"NUMBA_CACHE_DIR": str(tmp_path / "numba-cache")}
    model = tiny(vocab="bpe", weight_type="Q8_0")
    runs = [run("generate", "Once upon", "--model", model, "--backend", "numba", "--max-tokens", "0", env=env)
            for _ in range(2)]
    assert all(r.returncode == 0 for r in runs), runs[0].stderr
    assert "note: numba compiled" in runs[0].stderr and "the first request compiles the rest" in runs[0].stderr
    assert "compiled" not in runs[1].stderr, runs[1].stderr


def test_generate_default_model_matches_api(default_model, engine_q41):
    r = run("generate", "Once upon a time, there was a little", "--max-tokens", "16")
    assert r.returncode == 0, r.stderr
    api = "".join(engine_q41.generate("Once upon a time, there was a little", max_tokens=16))
    assert r.stdout == api + "\n"


def test_inspect(tiny):
    r = run("inspect", "--model", tiny(vocab="bpe", n_kv_heads=2))
    assert r.returncode == 0, r.stderr
    assert "n_kv_heads         2" in r.stdout and "rope_style         adjacent" in r.stdout
    assert "<|im_end|>" in r.stdout


def test_missing_file(tmp_path):
    assert_one_line_error(run("generate", "hi", "--model", tmp_path / "missing.gguf"), "no such file")


def test_not_gguf(tmp_path):
    p = tmp_path / "notes.gguf"
    p.write_text("hello, I am a text file\n" * 20)
    assert_one_line_error(run("inspect", "--model", p), "not a GGUF file")


def test_truncated(tiny, tmp_path):
    p = tmp_path / "half.gguf"
    data = tiny().read_bytes()
    p.write_bytes(data[: len(data) // 2])
    assert_one_line_error(run("generate", "hi", "--model", p), "truncated")


def test_unsupported_architecture(tiny, tmp_path):
    p = tmp_path / "arch.gguf"
    data = tiny().read_bytes()
    p.write_bytes(data.replace(b"\x05\x00\x00\x00\x00\x00\x00\x00llama", b"\x05\x00\x00\x00\x00\x00\x00\x00gptjx", 1))
    assert_one_line_error(run("generate", "hi", "--model", p), "architecture 'gptjx'")


def test_empty_prompt(tiny):
    assert_one_line_error(run("generate", "", "--model", tiny()), "empty prompt")


def test_prompt_longer_than_context(tiny):
    assert_one_line_error(run("generate", "word " * 400, "--model", tiny(context_length=128)), "context holds 128")


def test_out_of_range_sampling_parameters_are_rejected(tiny):
    assert_one_line_error(run("generate", "hi", "--model", tiny(), "--temperature", "-0.8"), "temperature")
    assert_one_line_error(run("generate", "hi", "--model", tiny(), "--top-p", "1.5"), "--top-p")


def test_sampling_with_a_seed_is_reproducible(tiny):
    args = ("generate", "Once upon", "--model", tiny(), "--temperature", "1.0", "--top-k", "20", "--seed", "9",
            "--max-tokens", "12", "--ignore-eos")
    a, b = run(*args), run(*args)
    assert a.returncode == 0 and a.stdout == b.stdout and "seed 9" in a.stderr


def test_no_vocab_model_needs_token_ids(tiny):
    assert_one_line_error(run("generate", "hi", "--model", tiny(vocab="none")), "no vocabulary")


def test_convert_f32_roundtrip(tiny, tmp_path):
    import numpy as np

    import llorch_ref

    src = tiny(weight_type="Q8_0")
    out = tmp_path / "f32.gguf"
    r = run("convert", "--to", "gguf", "--dtype", "float32", src, out)
    assert r.returncode == 0, r.stderr
    a, b = llorch_ref.load(src), llorch_ref.load(out)
    assert set(b.tensor_types.values()) == {"F32"}
    assert a.tokenizer.tokens == b.tokenizer.tokens and a.tokenizer.chat_template == b.tokenizer.chat_template
    np.testing.assert_array_equal(a.logits([1, 2, 3]), b.logits([1, 2, 3]))
    assert_one_line_error(run("convert", src, out), "already exists")


@pytest.mark.parametrize("flag", ["--prefill", "--decode", "--repeats", "--threads"])
def test_bench_counts_below_one_are_rejected(tiny, flag):
    """A count of 0 gave a median of nothing, 0 tok/s, or (--threads 0) all cores: now refused by the parser, the
    flag named, as generate's --threads is."""
    r = run("bench", "--model", tiny(), "--engines", "numpy", flag, "0")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert f"argument {flag}: 0 is not in 1.." in r.stderr.splitlines()[-1]


def test_threads_zero_is_refused_not_taken_as_all_cores(tiny):
    """The API's threads=0 was read as "not given" (all cores); now a ParameterError."""
    import llorch_ref
    from llorch_ref.errors import ParameterError

    pytest.importorskip("numba")
    with pytest.raises(ParameterError, match="threads=0"):
        llorch_ref.load(tiny(), backend="numba", threads=0)


def test_bench_without_an_engine_is_refused(tiny):
    assert_one_line_error(run("bench", "--model", tiny(), "--engines", ","), "--engines names no engine")
