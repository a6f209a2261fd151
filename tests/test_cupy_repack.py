"""Q6_K blocks repacked at load for aligned loads (cuda_blocks.GpuBlocks.repacked, REPACKED): the same
products to the bit as the file's layout, one token and several, in the op-by-op and the fused decode step, and
every checkpoint against the numpy oracle. Needs a GPU (skips without one)."""
from __future__ import annotations

import numpy as np
from llorch_test_helpers import need_backend

import llorch_ref
from llorch_ref.testing.blocks import random_qtensor


def file_and_packed(qt, n, k, seed):
    import cupy as cp

    from llorch_ref.backends.cuda_blocks import GpuBlocks
    q = random_qtensor(qt, n, k, seed)
    file = GpuBlocks(qt, q.shape, cp.asarray(q.blocks), cp)
    return q, file, file.repacked()


def test_repacked_blocks_give_the_file_layouts_products_to_the_bit(monkeypatch):
    """70 rows of 5 super-blocks: the repacked matrix dequantizes bit for bit as gguf-py does, and its one-token
    product (every lane's oct from two aligned loads), a slice's, and a three-token product equal the file
    layout's to the bit; with LLORCH_CUDA_REPACK=0 the file's layout stays; other types are not repacked."""
    qt = "Q6_K"
    need_backend("cupy")
    import cupy as cp

    from llorch_ref.backends.cuda_blocks import REPACKED
    q, file, packed = file_and_packed(qt, 70, 256 * 5, 11)
    fmt, size = REPACKED[qt]
    assert file.fmt == qt.lower() and packed.fmt == fmt and packed.blocks.shape == (70, 5 * size)
    np.testing.assert_array_equal(cp.asnumpy(packed.dequantize()), q.dequantize())
    x = cp.asarray(np.random.default_rng(12).standard_normal((3, 256 * 5)).astype(np.float32))
    for rows in (x[:1], x):
        np.testing.assert_array_equal(cp.asnumpy(packed.matmul(rows)), cp.asnumpy(file.matmul(rows)))
    np.testing.assert_array_equal(cp.asnumpy(packed[3:70].matmul(x[:1])), cp.asnumpy(file[3:70].matmul(x[:1])))
    _, q4, same = file_and_packed("Q4_0", 8, 512, 13)
    assert same is q4
    monkeypatch.setenv("LLORCH_CUDA_REPACK", "0")
    assert file.repacked() is file


def test_a_repack_with_two_super_blocks_scales_swapped_is_caught():
    """Planted bug: a row's two super-blocks with their float16 scales d swapped give other products than the
    file's."""
    need_backend("cupy")
    import cupy as cp

    from llorch_ref.backends.cuda_blocks import GpuBlocks
    _, file, packed = file_and_packed("Q6_K", 16, 512, 14)
    good = packed.blocks.reshape(16, 2, 224)
    raw = good.copy()
    raw[:, 0, 208:210], raw[:, 1, 208:210] = good[:, 1, 208:210], good[:, 0, 208:210]
    bad = GpuBlocks("Q6_K", (16, 512), raw.reshape(16, -1), cp, "q6_kr")
    x = cp.asarray(np.random.default_rng(15).standard_normal((1, 512)).astype(np.float32))
    assert not np.array_equal(cp.asnumpy(bad.matmul(x)), cp.asnumpy(file.matmul(x)))


def test_a_repacked_model_decodes_as_the_file_layout_to_the_bit_and_meets_the_oracle(tiny, monkeypatch):
    """Q4_K beside Q6_K as in a Q4_K_M file, its Q6_K matrices repacked: eight greedy steps of the fused decode step
    (graph replays included) give the file layout's logits to the bit (LLORCH_CUDA_REPACK=0), and every
    checkpoint of a prompt and 16 greedy steps meets the numpy oracle's band."""
    need_backend("cupy")
    import cupy as cp

    from llorch_ref.harness.run import run_backend_diff
    path = tiny(vocab="bpe", n_layers=2, d_model=256, d_ff=512, context_length=256, weight_type="k_mixed")
    got = {}
    for repack in ("1", "0"):
        monkeypatch.setenv("LLORCH_CUDA_REPACK", repack)
        eng = llorch_ref.load(path, backend="cupy", dtype="blocks")
        fmts = {w.fmt for lw in eng.weights.layers for w in vars(lw).values() if hasattr(w, "fmt")}
        assert any(f.endswith("r") for f in fmts) is (repack == "1"), fmts
        cache, ids = eng.new_cache(), [(7 * i + 3) % 200 + 1 for i in range(9)]
        tok = int(cp.asnumpy(eng.forward(ids, cache, rows=[len(ids) - 1])).argmax())
        dec = eng.backend.make_decoder(eng, cache)
        assert eng.backend.info["fused_decode"]
        rows = []
        for _ in range(8):
            rows.append(cp.asnumpy(dec(tok)).copy())
            tok = int(rows[-1].argmax())
        got[repack] = np.concatenate(rows)
        if repack == "1":
            res = run_backend_diff(eng, llorch_ref.load(path), n_greedy=16)
            assert res.first_divergence is None, res.first_divergence
    np.testing.assert_array_equal(got["1"], got["0"])
