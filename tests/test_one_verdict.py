"""One file, one verdict: `llorch-ref diff --subject`, the Python API (check_dump, run_subject) and the pytest
plugin judge the same llama.cpp dump alike (status, exit code, first divergence), with llama.cpp's default
settings and with flash attention and an F16 cache, clean and with a planted error."""
from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

import llorch_ref
from llorch_ref.cli import main
from llorch_ref.dump import load_dump
from llorch_ref.harness.run import check_dump, run_subject

SETTINGS = {"default": {}, "flash-attn f16": {"flash_attn": True, "kv_dtype": "float16"}}
PLANTS = {"clean": None, "attn_out L1 x1.05": ("cp5.attn_out.layer1", 1.05)}


@pytest.fixture(scope="module")
def model(tiny):
    return tiny(weight_type="Q4_0", n_layers=2, vocab="bpe")


@pytest.fixture(scope="module")
def dumps(llamacpp, model, tmp_path_factory):
    """{(settings, plant): path} of llama.cpp dumps, the planted ones edited after llama.cpp wrote them."""
    from llorch_ref.references.engines import dump_llamacpp
    d = tmp_path_factory.mktemp("one-verdict")
    out = {}
    for sname, kw in SETTINGS.items():
        clean = dump_llamacpp(str(model), prompt="Once upon a time, there was", n_greedy=8, **kw)
        for pname, plant in PLANTS.items():
            rec = copy.copy(clean)
            rec.tensors = {k: v.copy() for k, v in clean.tensors.items()}
            if plant:
                rec.tensors[plant[0]] *= np.float32(plant[1])
            out[(sname, pname)] = rec.save(d / f"{sname}-{pname}.safetensors".replace(" ", "_"))
    return out


def _plugin(path, model, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    proj = tmp_path / "proj"
    proj.mkdir(exist_ok=True)
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
                        f"--llorch-dump={path}", f"--llorch-model={model}"], cwd=proj, capture_output=True,
                       text=True, env=env, timeout=600)
    m = re.search(r"^verdict: (PASS|FAIL|INCOMPLETE)", r.stdout, re.M)
    fd = re.search(r"^first divergence: (.*)$", r.stdout, re.M)
    return r.returncode, (m[1] if m else None), (fd[1] if fd else None), r.stdout[-3000:]


@pytest.mark.llamacpp
@pytest.mark.parametrize("settings", list(SETTINGS))
@pytest.mark.parametrize("plant", list(PLANTS))
def test_cli_api_and_plugin_give_one_verdict(dumps, model, settings, plant, tmp_path, capsys):
    path = dumps[(settings, plant)]
    rc = main(["diff", "--subject", str(path), "--model", str(model), "--json"])
    cli = json.loads(capsys.readouterr().out)["verdict"]
    api = check_dump(path, model=model).verdict()
    readme = run_subject(llorch_ref.load(model), load_dump(path)).verdict()     # the README's two lines
    prc, pstatus, pfd, out = _plugin(path, model, tmp_path)

    want = "PASS" if plant == "clean" else "FAIL"
    assert cli["status"] == api.status == readme.status == pstatus == want, out
    assert rc == api.exit_code == readme.exit_code == (0 if want == "PASS" else 1)
    assert (prc == 0) == (want == "PASS"), out
    assert cli["first_divergence"] == api.first_divergence == readme.first_divergence
    if want == "FAIL":
        fd = api.first_divergence
        assert (fd["checkpoint"], fd["layer"], fd["tensor"], fd["by"]) == ("5", 1, "attn_out", "local error")
        assert pfd.startswith("checkpoint 5, layer 1, attn_out"), out
    else:
        assert pfd == "none", out
