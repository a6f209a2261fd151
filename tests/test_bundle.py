"""Proof bundles: layout, contents, atomic writes, never overwriting a run id."""
from __future__ import annotations

import json

import numpy as np
import pytest

import llorch_ref
from llorch_ref.errors import HarnessError


@pytest.fixture(scope="module")
def tiny_result(tiny, llamacpp):
    from llorch_ref.harness.run import run_diff

    eng = llorch_ref.load(tiny(vocab="bpe"))
    return eng, run_diff(eng, prompt="Once upon a time, there was a little", n_greedy=4)


def test_bundle_layout_and_contents(tiny_result, tmp_path):
    from llorch_ref.harness.bundle import write_bundles

    eng, res = tiny_result
    out = write_bundles(res, eng, out_dir=tmp_path, run_id="r1", argv=["llorch-ref", "prove"])
    assert out["index"] == tmp_path / "r1.md" and out["index"].exists()
    assert len(out["bundles"]) == 14
    d = tmp_path / "cp4_attention_scores" / "r1"
    assert sorted(p.name for p in d.iterdir()) == ["error_by_layer.png", "manifest.json",
                                                   "reference.npz", "report.json", "report.md", "subject.npz"]
    man = json.loads((d / "manifest.json").read_text())
    for key in ("llorch_ref_version", "git_commit", "numpy", "gguf", "llama_cpp_python", "cpu_flags",
                "model_sha256", "backend", "prompt", "token_ids", "sides", "seed", "command"):
        assert key in man, key
    llama = man["sides"]["reference"]["arithmetic"]["settings"]
    assert llama["flash_attn"] is False and llama["type_k"] == "f32"
    ours, ref = np.load(d / "subject.npz"), np.load(d / "reference.npz")
    assert {"cp4.kq.layer0", "cp4.kq_soft_max.layer1"} <= set(ours.files) and set(ours.files) == set(ref.files)
    rep = json.loads((d / "report.json").read_text())
    assert rep["passed"] is True and len(rep["rows"]) == 2 * eng.config.n_layers
    assert {"max_abs", "max_rel", "nmse", "cosine", "band"} <= set(rep["rows"][0])
    assert "Verdict: PASS" in (d / "report.md").read_text()
    assert not list(tmp_path.glob(".incomplete-*"))


def test_existing_run_id_is_never_overwritten(tiny_result, tmp_path):
    from llorch_ref.harness.bundle import write_bundles

    eng, res = tiny_result
    write_bundles(res, eng, out_dir=tmp_path, run_id="same")
    before = (tmp_path / "cp1_rms_norm" / "same" / "report.json").read_bytes()
    with pytest.raises(HarnessError, match="already exists"):
        write_bundles(res, eng, out_dir=tmp_path, run_id="same")
    assert (tmp_path / "cp1_rms_norm" / "same" / "report.json").read_bytes() == before


def test_interrupted_write_leaves_nothing_that_looks_complete(tiny_result, tmp_path, monkeypatch):
    from llorch_ref.harness import bundle

    eng, res = tiny_result
    calls = {"n": 0}
    orig = np.savez_compressed

    def failing(*a, **k):
        calls["n"] += 1
        if calls["n"] == 7:
            raise KeyboardInterrupt("simulated interrupt while writing")
        return orig(*a, **k)
    monkeypatch.setattr(bundle.np, "savez_compressed", failing)
    with pytest.raises(KeyboardInterrupt):
        bundle.write_bundles(res, eng, out_dir=tmp_path, run_id="cut")
    assert not (tmp_path / "cut.md").exists()
    assert not list(tmp_path.glob("cp*/cut"))
    assert not list(tmp_path.glob(".incomplete-*"))
    monkeypatch.setattr(bundle.np, "savez_compressed", orig)
    assert bundle.write_bundles(res, eng, out_dir=tmp_path, run_id="cut")["index"].exists()   # rerun works


def test_run_id_and_dir_from_environment(tiny_result, tmp_path, monkeypatch):
    from llorch_ref.harness.bundle import write_bundles

    eng, res = tiny_result
    monkeypatch.setenv("LLORCH_RUN_ID", "from-env")
    monkeypatch.setenv("LLORCH_PROOF_DIR", str(tmp_path / "pb"))
    out = write_bundles(res, eng)
    assert out["index"] == tmp_path / "pb" / "from-env.md"


def test_greedy_band_never_asks_for_more_tokens_than_generated():
    from llorch_ref.checkpoints import greedy_band
    assert greedy_band({"equal_prefix": 6}, 4) == {"equal_prefix": 4}
    assert greedy_band({"equal_prefix": 6}, 64) == {"equal_prefix": 6}
    assert greedy_band({"agreement": 1.0}, 4) == {"agreement": 1.0}
