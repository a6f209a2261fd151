"""llama.cpp's capture copies out of a node only what a long prompt keeps: the kept indices along the node's
token axis (the sampled rows of each micro-batch, the score rows of kq/kq_soft_max), a cache from the last
micro-batch only. The same values as the whole node cut afterwards, a fraction of the bytes."""
from __future__ import annotations

import numpy as np
import pytest

import llorch_ref

TEXT = ("The history of the Roman Empire spans many centuries, from the founding of the city to the fall of "
        "Constantinople in 1453, and its")


@pytest.fixture(scope="module")
def q8(tiny):
    return tiny(weight_type="Q8_0", n_layers=3, d_model=128, d_ff=192, vocab="bpe")


def captured(ctx, ids, rows=None) -> dict:
    """Every checkpoint node of one forward of ids (one micro-batch), whole or as rows(graph, name) asks."""
    from llorch_ref.checkpoints import load_specs
    from llorch_ref.dump import Recorder
    from llorch_ref.references.engines import _LlamaCppCapture, gguf_config
    from llorch_ref.references.llamacpp import Capture

    names = _LlamaCppCapture(Recorder("llama.cpp"), load_specs(None), gguf_config(ctx.path), False, "ggml").names
    cap = Capture(names=names, rows=rows)
    ctx.eval(ids, cap)
    return cap.tensors


@pytest.mark.llamacpp
@pytest.mark.parametrize("axis", [0, 1, 2])
def test_indices_read_along_any_axis_are_the_whole_node_cut(llamacpp, q8, axis):
    from llorch_ref.references.llamacpp import LlamaCpp

    ids = llorch_ref.load(q8).tokenizer.encode(TEXT)
    ctx = LlamaCpp(q8, n_ctx=256, kv_dtype="float32", n_ubatch=128)           # one micro-batch
    try:
        whole = captured(ctx, ids)
        shapes = {}
        for key, a in whole.items():
            shapes.setdefault(key[0], set()).add(a.shape)
        one = {name: next(iter(s)) for name, s in shapes.items() if len(s) == 1}   # the names of one shape

        def rows(g, name):            # every third index of the axis (the last axis where the node has fewer)
            if name not in one:
                return None
            ax = min(axis, len(one[name]) - 1)
            return ax, list(range(0, one[name][ax], 3))
        cut = captured(ctx, ids, rows)
        with pytest.raises(Exception, match="indices"):
            captured(ctx, ids, lambda g, name: (0, [10**6]))          # out of range: an error, not garbage
    finally:
        ctx.close()
    assert set(cut) == set(whole) and sum(k[0] in one for k in whole) > 30
    for key, a in whole.items():
        ax = min(axis, a.ndim - 1)
        want = np.take(a, np.arange(0, a.shape[ax], 3), axis=ax) if key[0] in one else a
        assert cut[key].dtype == np.float32 and np.array_equal(cut[key], want), key


@pytest.mark.llamacpp
def test_a_dump_of_sampled_rows_reads_a_fraction_of_the_bytes(llamacpp, q8, monkeypatch):
    from llorch_ref.references import llamacpp as LC
    from llorch_ref.references.engines import dump_llamacpp

    ids = llorch_ref.load(q8).tokenizer.encode(TEXT)
    funcs = LC._ggml_funcs()
    get, read = funcs["ggml_backend_tensor_get"], []
    monkeypatch.setitem(funcs, "ggml_backend_tensor_get", lambda t, dst, off, n: (read.append(n), get(t, dst, off, n)))
    whole = dump_llamacpp(q8, token_ids=ids, n_greedy=0, n_ubatch=7)
    every_row = sum(read)
    read.clear()
    rows = [0, 13, len(ids) - 1]
    part = dump_llamacpp(q8, token_ids=ids, n_greedy=0, n_ubatch=7, rows=rows)
    # 3 of the prompt's rows, the caches of 1 of its micro-batches: under a third of the bytes
    assert sum(read) < every_row / 3, (sum(read), every_row, len(ids))
    assert part.extra["capture_invariance"]["logits_max_abs_diff"] == 0.0
    assert set(part.tensors) == set(whole.tensors)
