"""`llorch-ref diff --reference-model X`: llama.cpp runs a copy of the model with one thing changed, and
the diff must name the right checkpoint and layer as the first divergence. The command runs in this process
(llorch_ref.cli.main: the parser, the command and its --json output as the console script runs them)."""
from __future__ import annotations

import json

import numpy as np
import pytest


@pytest.fixture(scope="module")
def changed_copies(default_f32, tmp_path_factory):
    """The F32 copy with one change each, made in a copy of the file: the epsilon's float32 rewritten in the
    metadata; blk.7.ffn_up.weight x1.05 (testing.plant.plant_scale: every weight times np.float32(1.05))."""
    import shutil

    import gguf

    from llorch_ref.testing.plant import plant_scale

    d = tmp_path_factory.mktemp("changed")
    eps = shutil.copyfile(default_f32, d / "eps.gguf")
    reader = gguf.GGUFReader(eps, "r+")
    field = reader.fields["llama.attention.layer_norm_rms_epsilon"]
    field.parts[field.data[0]][0] = np.float32(1e-6)
    reader.data.flush()
    del reader
    return {"eps": eps, "ffn7": plant_scale(default_f32, d / "ffn7.gguf", "blk.7.ffn_up.weight", 1.05)}


def diff_json(model, reference, capsys):
    from llorch_ref.cli import main

    capsys.readouterr()
    rc = main(["diff", "--model", str(model), "--reference-model", str(reference), "--json", "--greedy", "8"])
    out, err = capsys.readouterr()
    assert rc in (0, 1), err
    return json.loads(out), rc


@pytest.mark.parametrize("change, expected", [("eps", {"checkpoint": "1", "layer": 0}),
                                              ("ffn7", {"checkpoint": "6", "layer": 7})])
def test_diff_names_the_changed_place(default_f32, changed_copies, llamacpp, capsys, change, expected):
    out, rc = diff_json(default_f32, changed_copies[change], capsys)
    fd = out["first_divergence"]
    print(change, json.dumps(fd), [s for s in out["summary"] if not s["passed"]][:2])
    assert rc == 1
    assert {"checkpoint": fd["checkpoint"], "layer": fd["layer"]} == expected


def test_diff_same_file_has_no_divergence(default_f32, llamacpp, shared_llama_dumps, capsys):
    """The F32 copy against itself (llama.cpp's dump of it shared with the planted runs': shared_llama_dumps)."""
    out, rc = diff_json(default_f32, default_f32, capsys)
    assert rc == 0 and out["first_divergence"] is None and out["passed"] is True
    assert out["band_class"] == "F32"
