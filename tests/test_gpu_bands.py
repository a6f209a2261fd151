"""The '+cuda' band classes: llama.cpp's GPU backend judged by bands measured on it (tools/calibrate_bands.py
--gpu-layers 99), chosen for a dump that declares layers on the GPU and for `diff --gpu-layers`, and still
failing a planted K/V cache bug on the default model; every spec holds every such band, measured."""
from __future__ import annotations

import pytest

from llorch_ref.checkpoints import GPU, GPU_CLASSES, coarser, load_specs, on_gpu
from llorch_ref.harness.run import run_subject
from llorch_ref.harness.verdict import FAIL, PASS
from llorch_ref.references.llorch import record_engine
from llorch_ref.testing.plant import CACHE_BUGS

PROMPT = "Once upon a time, there was"
GPU_DECLARED = {"numerics": "exact", "kv_dtype": "float32", "reproducible": False,
                "settings": {"n_gpu_layers": 99, "offload_kqv": True}}


def test_every_spec_has_a_measured_band_for_every_gpu_class():
    for s in load_specs():
        for cls in GPU_CLASSES:
            assert s.band(cls + GPU), (s.id, cls)
            m = s.measured["by_class"][cls + GPU]
            assert m["gpu_layers"] == 99 and m["prompts"] >= 13, (s.id, cls, m)


def test_the_gpu_bands_are_no_tighter_than_the_cpu_ones_where_cuda_sums_differ_more():
    """Measured, not assumed: llama.cpp's CUDA sums sit further from the reference than its CPU sums on the
    quantized classes (the reason the class exists); a band as tight as the CPU's would fail a clean GPU run."""
    wider = [s.id for s in load_specs() if "nmse" in s.band("Q4_x") and s.band("Q4_x" + GPU)["nmse"] > s.band("Q4_x")["nmse"]]
    assert len(wider) >= 8, wider


def test_a_gpu_class_stays_on_the_gpu_when_made_coarser():
    assert coarser("F32" + GPU, "F16") == on_gpu("F16")
    assert coarser("Q4_x", "K" + GPU) == on_gpu("Q4_x")
    assert coarser("Q8_0", "K") == "K" and on_gpu(on_gpu("K")) == on_gpu("K")


def gpu_dump(eng, monkeypatch, plant=None):
    ids = eng.tokenizer.encode(PROMPT)
    with monkeypatch.context() as mp:
        if plant is not None:
            plant(mp, len(ids))
        rec = record_engine(eng, ids, prompt=PROMPT, n_greedy=8, decode_steps=3)
    rec.extra["arithmetic"] = GPU_DECLARED          # as `dump --engine llamacpp --gpu-layers 99` declares
    return rec.to_dump()


@pytest.mark.parametrize("bug", [None, "cache rows 0..3 scaled after decode step 1"])
def test_a_gpu_dump_of_the_default_model_is_judged_by_the_cuda_bands(engine_q41, monkeypatch, bug):
    plant = CACHE_BUGS[bug][0] if bug else None
    res = run_subject(engine_q41, gpu_dump(engine_q41, monkeypatch, plant))
    v = res.verdict()
    assert res.band_class == "Q4_x" + GPU and res.local_declaration is None
    if bug is None:
        assert v.status == PASS, v.line()
    else:
        assert v.status == FAIL and v.first_divergence["step"] == 2, v.first_divergence
