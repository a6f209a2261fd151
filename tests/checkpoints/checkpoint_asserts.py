"""Assertions shared by the checkpoint tests."""
from __future__ import annotations

N_LAYERS = 30          # SmolLM2-135M; checked against the model in the diff_f32 fixture


def rows_of(res, checkpoint, layer="any"):
    rows = [r for r in res.rows if r.checkpoint == checkpoint and (layer == "any" or r.layer == layer)]
    assert rows, f"no comparison recorded for checkpoint {checkpoint} layer {layer}"
    return rows


def assert_in_band(res, checkpoint, layer="any"):
    rows = rows_of(res, checkpoint, layer)
    for r in rows:
        m = {k: v for k, v in r.metrics.items() if k not in ("ours", "reference")}
        print(f"cp{checkpoint} layer {r.layer} {r.tensor}: {m} band {r.band}")
    bad = [(r.layer, r.tensor, r.metrics.get("nmse"), r.band) for r in rows if not r.passed]
    assert not bad, f"out of band: {bad}"


def assert_first_divergence(res, checkpoint, layer):
    fd = res.first_divergence
    assert fd is not None, "the planted bug was not caught: every checkpoint stayed in band"
    assert (fd["checkpoint"], fd["layer"]) == (checkpoint, layer), fd
    assert not res.passed(checkpoint)
