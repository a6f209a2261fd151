"""`llorch-ref diff --reference-model X`: llama.cpp runs a copy of the model with one thing changed, and
the diff must name the right checkpoint and layer as the first divergence."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest


@pytest.fixture(scope="module")
def changed_copies(default_model, tmp_path_factory):
    from llorch_ref.convert import convert_gguf

    d = tmp_path_factory.mktemp("changed")
    eps = convert_gguf(default_model, d / "eps.gguf", kv_overrides={"llama.attention.layer_norm_rms_epsilon": 1e-6})

    def bump_ffn7(name, arr):
        return arr * np.float32(1.05) if name == "blk.7.ffn_up.weight" else arr
    ffn = convert_gguf(default_model, d / "ffn7.gguf", tensor_fn=bump_ffn7)
    return {"eps": eps, "ffn7": ffn}


def diff_json(model, reference):
    r = subprocess.run([sys.executable, "-m", "llorch_ref.cli", "diff", "--model", str(model),
                        "--reference-model", str(reference), "--json", "--greedy", "8"],
                       capture_output=True, text=True, timeout=600, env=dict(os.environ))
    assert r.returncode in (0, 1), r.stderr
    return json.loads(r.stdout), r.returncode


@pytest.mark.parametrize("change, expected", [("eps", {"checkpoint": "1", "layer": 0}),
                                              ("ffn7", {"checkpoint": "6", "layer": 7})])
def test_diff_names_the_changed_place(default_f32, changed_copies, llamacpp, change, expected):
    out, rc = diff_json(default_f32, changed_copies[change])
    fd = out["first_divergence"]
    print(change, json.dumps(fd), [s for s in out["summary"] if not s["passed"]][:2])
    assert rc == 1
    assert {"checkpoint": fd["checkpoint"], "layer": fd["layer"]} == expected


def test_diff_same_file_has_no_divergence(default_f32, llamacpp):
    out, rc = diff_json(default_f32, default_f32)
    assert rc == 0 and out["first_divergence"] is None and out["passed"] is True
    assert out["band_class"] == "F32"
