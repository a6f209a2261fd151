"""Backends against the numpy oracle: every checkpoint, with the bands of checkpoints/backend_bands.json."""
from __future__ import annotations

import numpy as np
import pytest
from llorch_test_helpers import need_backend

import llorch_ref
from llorch_ref.errors import ParameterError
from llorch_ref.testing.blocks import SCALES_AT, random_qtensor


@pytest.mark.parametrize("kw", [dict(vocab="bpe", weight_type="Q8_0"), dict(vocab="bpe", weight_type="Q4_1"),
                                dict(vocab="bpe", weight_type="Q4_0", n_kv_heads=4), dict(vocab="bpe")],
                         ids=["q8_0", "q4_1", "q4_0-mha", "f32"])
@pytest.mark.parametrize("weights", ["lazy", "eager"])
def test_numba_checkpoints_against_numpy_tiny(tiny, kw, weights):
    """Lazy weights (the default for GGUF): the kernels read the file's blocks for one token and for several (no
    float32 copy kept); eager: float32 weights kept, several-token products by BLAS on them."""
    need_backend("numba")
    from llorch_ref.harness.run import run_backend_diff

    path = tiny(**kw)
    eng = llorch_ref.load(path, backend="numba", weights=weights)
    assert eng.weights_info()["lazy"] is (weights == "lazy")
    res = run_backend_diff(eng, llorch_ref.load(path), n_greedy=16)
    assert res.first_divergence is None, res.first_divergence
    assert res.greedy["equal_prefix"] == 16


def test_numba_lazy_uncached_prefill_runs_the_kernels_and_meets_the_bands(tiny):
    """Lazy weights with a cache of 0 MB: several-token products run the kernels on the blocks instead of
    dequantizing every matrix at every forward; each row is then exactly what the one-token kernel gives."""
    need_backend("numba")
    from llorch_ref.harness.run import run_backend_diff

    path = tiny(vocab="bpe", weight_type="Q4_1")
    eng = llorch_ref.load(path, backend="numba", weights="lazy", weight_cache_mb=0)
    lw = eng.weights.layers[0]
    x = np.random.default_rng(0).standard_normal((5, lw.wq.shape[1])).astype(np.float32)
    rows = lw.wq.matmul(x)
    assert np.array_equal(rows, np.concatenate([lw.wq.matmul(x[i:i + 1]) for i in range(5)]))
    assert not np.array_equal(rows, x @ lw.wq._dense().T)          # not BLAS on the float32 weight
    res = run_backend_diff(eng, llorch_ref.load(path), n_greedy=8)
    assert res.first_divergence is None, res.first_divergence
    worst = max(r.metrics["nmse"] for r in res.rows if r.tensor == "l_out")
    assert 0 < worst < 1e-9                                            # the prompt rows now differ from numpy's
    assert eng.weights_info()["hits"] == 0                             # nothing was dequantized and kept


def test_numba_lazy_default_keeps_no_float32_copy_and_runs_prompts_on_the_blocks(tiny, monkeypatch):
    """Every matrix on a kernel (Q4_1 here): the default weight cache gives up its float32 copy (a 7B file had been
    held as 25 GB of float32 on a 128 GiB machine, 8x the file) and a prompt's products run on the blocks, with BLAS
    on one thread while it runs (its threads, spinning after each call, had halved the kernels' speed); a budget
    the user asks for is kept and prompts go to BLAS on the float32 weights. A model with a matrix no kernel
    serves (float32 weights) keeps the default cache, and LLORCH_BLAS_SPLIT=blas keeps BLAS's threads."""
    need_backend("numba")
    from threadpoolctl import threadpool_info

    from llorch_ref.backends import numba_backend as NB
    from llorch_ref.backends.cpu_split import SPLIT

    def blas_threads():
        return max(i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas")

    path = tiny(vocab="bpe", weight_type="Q4_1")
    eng = llorch_ref.load(path, backend="numba", threads=2)
    info = eng.weights_info()
    assert (info["budget_mb"], info["budget_by"]) == (0, "default")
    assert eng.backend.info["prompts"] == "kernels on the blocks"
    NB.PATHS.clear()
    logits = eng.forward(list(range(1, 9)), eng.new_cache())
    assert blas_threads() == 1 and SPLIT.split                        # the prompt ran with BLAS on one thread
    assert NB.PATHS[("Q4_1", "numba kernel (in place)", "several rows")] > 0
    assert not any(path_ == "BLAS on the float32 weight" for _, path_, _ in NB.PATHS)
    assert eng.weights_info()["used_mb"] == 0

    kept = llorch_ref.load(path, backend="numba", threads=2, weight_cache_mb=64)
    assert (kept.weights_info()["budget_mb"], kept.weights_info()["budget_by"]) == (64, "user")
    assert kept.backend.info["prompts"] == "BLAS on float32 weights"
    NB.PATHS.clear()
    near = kept.forward(list(range(1, 9)), kept.new_cache())
    assert NB.PATHS[("Q4_1", "BLAS on the float32 weight", "several rows")] > 0
    assert kept.weights_info()["used_mb"] > 0
    assert np.abs(near - logits).max() <= 1e-4 * np.abs(logits).max()

    dense = llorch_ref.load(tiny(vocab="bpe"), backend="numba", threads=2)      # float32 matrices: no kernels
    assert dense.weights_info()["budget_mb"] > 0 and dense.backend.info["prompts"] == "BLAS on float32 weights"

    monkeypatch.setenv("LLORCH_BLAS_SPLIT", "blas")
    eng = llorch_ref.load(path, backend="numba", threads=2)
    eng.forward(list(range(1, 9)), eng.new_cache())
    assert blas_threads() == 2 and not SPLIT.split


def test_loading_a_cpu_backend_never_probes_cupy(monkeypatch):
    """get_backend("numba") probes numba alone: cupy's import and CUDA's device count (where cupy is installed, as
    on the GPU host) are not part of a numba load. The spy sees cupy probed when all are asked."""
    import importlib.abc
    import sys

    from llorch_ref.backends import available, get_backend

    need_backend("numba")
    seen = []

    class Spy(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name.split(".")[0] == "cupy":
                seen.append(name)
            return None

    monkeypatch.setattr(sys, "meta_path", [Spy()] + sys.meta_path)
    monkeypatch.delitem(sys.modules, "cupy", raising=False)
    get_backend("numba", threads=1)
    get_backend("numpy", threads=1)
    assert seen == []
    assert set(available(("numba",))) == {"numba"}
    available()
    assert seen and seen[0] == "cupy"


def test_numba_workers_spin_as_libgomp_has_them_only_with_cores_to_spare(monkeypatch):
    """GOMP_SPINCOUNT: 1000 where this process's threads and the machine's load leave no core spare (2 threads on
    2 cores; 2 threads on 16 cores under a load of 14), libgomp's default with cores to spare (2 threads on 16 cores,
    load 0.8), and a value the user set is kept either way."""
    import os

    from llorch_ref.backends import cpu_split
    from llorch_ref.backends import numba_backend as NB

    def machine(cores, load):
        monkeypatch.setattr(cpu_split.os, "sched_getaffinity", lambda pid: set(range(cores)))
        monkeypatch.setattr(cpu_split.os, "getloadavg", lambda: (load, load, load))

    for cores, load, user, want in ((2, 0.1, None, "1000"), (16, 14.0, None, "1000"), (16, 0.8, None, None),
                                    (16, 0.8, "50000", "50000"), (2, 0.1, "300000", "300000")):
        machine(cores, load)
        monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
        if user:
            monkeypatch.setenv("GOMP_SPINCOUNT", user)
        got = NB.choose_spin_count(2)
        assert os.environ.get("GOMP_SPINCOUNT") == want
        assert got == (want or "libgomp's default")


def test_numba_prompt_products_in_l2_sized_chunks_of_tokens_equal_the_whole_to_the_bit(monkeypatch):
    """KernelBlocks.matmul runs a prompt's tokens in chunks whose activations fit in L2 (tokens_per_chunk: from
    the L2 size Linux reports, in fours); chunks of 4 over 11 tokens (the last one short) give the unchunked
    products to the bit, for a legacy and a K-quant type."""
    need_backend("numba")
    from llorch_ref.backends import l2_bytes
    from llorch_ref.backends import numba_backend as NB

    assert NB.tokens_per_chunk(4096) % 4 == 0 and NB.tokens_per_chunk(4096) * 4 * 4096 <= 0.75 * l2_bytes() + 16384
    assert NB.tokens_per_chunk(10 ** 7) == 4
    x = np.random.default_rng(5).standard_normal((11, 512)).astype(np.float32)
    for qtype in ("Q4_1", "Q4_K"):
        kb = NB.KernelBlocks([random_qtensor(qtype, 48, 512, seed=2)])
        whole = kb.matmul(x)
        monkeypatch.setattr(NB, "tokens_per_chunk", lambda k: 4)
        assert np.array_equal(kb.matmul(x), whole)
        monkeypatch.undo()
        assert np.array_equal(whole[3], kb.matvec(x[3]))


def test_cpu_split_products_and_attention_equal_the_unsplit_ones_to_the_bit():
    """cpu_split: a product cut into row panels of the weight, one single-threaded BLAS call a thread, and attention on
    groups of KV heads (6 query heads on 3 KV heads, a cached prefix, a causal mask) give the unsplit results at 1, 2
    and 3 threads: attention to the bit; the product to the bit where OpenBLAS multiplies a panel with the kernel it
    uses for the whole (its SkylakeX set does on this shape; its Haswell set, which a machine's OPENBLAS_CORETYPE can
    force, does not: 118 of 1000 columns differ in their last bits), else each panel equal to the bit to the same
    BLAS call on that panel and the whole within float32 rounding of the float64 product. A split whose groups put
    their query heads in the wrong places (planted) does not give attention's result."""
    from threadpoolctl import threadpool_limits

    from llorch_ref.backends import blas_info
    from llorch_ref.backends.cpu_split import CpuSplit
    from llorch_ref.model import layers as L
    from llorch_ref.model.cache import visible_mask

    rng = np.random.default_rng(3)
    x, w = rng.standard_normal((37, 256)).astype(np.float32), rng.standard_normal((1000, 256)).astype(np.float32)
    t, s, h, kv, hd = 21, 29, 6, 3, 32
    q = rng.standard_normal((t, h, hd)).astype(np.float32)
    k, v = rng.standard_normal((s, kv, hd)).astype(np.float32), rng.standard_normal((s, kv, hd)).astype(np.float32)
    mask = visible_mask(np, np.arange(s - t, s)[:, None], np.arange(s)[None, :]).astype(np.float32)
    kv_head = L.kv_head_of(np, h, kv)
    with threadpool_limits(1, "blas"):
        want_y = x @ w.T
        want_att = L.attention(np, q, k, v, mask, 0.125, kv_head)[0]
        for threads in (1, 2, 3):
            split = CpuSplit(threads, mode="split")
            got = split.product(x, w)
            if not np.array_equal(got, want_y):
                assert "SkylakeX" not in blas_info(), "SkylakeX kernels gave these shapes equal products before"
                bounds = [1000 * i // threads for i in range(threads + 1)]
                for lo, hi in zip(bounds, bounds[1:]):
                    assert np.array_equal(got[:, lo:hi], x @ w[lo:hi].T)
                exact = x.astype(np.float64) @ w.T.astype(np.float64)
                assert np.abs(got - exact).max() <= 1e-6 * np.abs(exact).max()
            assert np.array_equal(split.attention_out(L.attention, np, q, k, v, mask, 0.125, kv_head), want_att)
            bad = split.attention_out(lambda xp, q, k, v, m, sc, kh: L.attention(xp, q[:, ::-1], k, v, m, sc, kh),
                                      np, q, k, v, mask, 0.125, kv_head)
            assert not np.array_equal(bad, want_att)                   # planted: each group's query heads reversed
            split.configure(1)


def test_numba_prefill_split_or_not_at_any_thread_count_equals_to_the_bit(tiny, monkeypatch):
    """The numba backend's several-token products and attention, split over its threads (as on a busy machine) or
    left to BLAS's threads: the prompt's logits and K/V cache at 1, 2 and 3 threads, split or not, equal to the bit
    with OpenBLAS's SkylakeX kernels (with its Haswell kernels within 1e-5 of the largest: 2.1e-5 of 8.3 measured);
    with nobody watching (generation's attention_out) equal to the recorded path's. A mode that is not one is an
    error."""
    need_backend("numba")
    from llorch_ref.backends.cpu_split import SPLIT

    path = tiny(vocab="bpe", weight_type="Q4_1", n_heads=4, n_kv_heads=2, d_model=128)
    ids = [(5 * i + 2) % 200 + 1 for i in range(40)]
    got = []
    for threads, mode in ((1, "blas"), (2, "split"), (2, "blas"), (3, "split")):
        monkeypatch.setenv("LLORCH_BLAS_SPLIT", mode)
        eng = llorch_ref.load(path, backend="numba", threads=threads)
        assert SPLIT.split is (mode == "split" and threads > 1)
        for record in ((lambda name, layer, arr: None), None):
            cache = eng.new_cache()
            logits = eng.forward(ids, cache, record=record)
            got.append((logits, cache.k[:, :cache.pos].copy(), cache.v[:, :cache.pos].copy()))
    if not all(np.array_equal(a, b) for other in got[1:] for a, b in zip(got[0], other)):
        # OpenBLAS's Haswell kernels (forced by a machine's OPENBLAS_CORETYPE) sum some outputs of a product in
        # other orders at other thread counts or panel widths; its SkylakeX kernels do not on these shapes
        from llorch_ref.backends import blas_info
        assert "SkylakeX" not in blas_info(), "SkylakeX kernels gave every thread count equal results before"
        for other in got[1:]:
            for a, b in zip(got[0], other):
                assert np.abs(a - b).max() <= 1e-5 * np.abs(a).max()
    monkeypatch.setenv("LLORCH_BLAS_SPLIT", "sometimes")
    with pytest.raises(ParameterError, match="LLORCH_BLAS_SPLIT"):
        llorch_ref.load(path, backend="numba")
    monkeypatch.delenv("LLORCH_BLAS_SPLIT")
    llorch_ref.load(path, backend="numba")


def test_numpy_backend_gives_blas_one_thread_for_a_step_while_the_machine_is_busy(tiny, monkeypatch):
    """The oracle on a busy machine (forced here by LLORCH_BLAS_SPLIT=split at 2 threads): its ops stay model.layers
    (a planted bug there reaches it); a one-token step runs BLAS on one thread, a prompt on the 2 asked for; the
    prompt's and the step's logits equal to the bit to those of BLAS's 2 threads throughout (one row's product does
    not depend on BLAS's thread count; several rows' can). Unforced, a look that finds the cores free gives BLAS its 2
    threads back."""
    from threadpoolctl import threadpool_info

    from llorch_ref.backends.cpu_split import SPLIT
    from llorch_ref.model import layers

    blas_threads = lambda: max(i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas")  # noqa: E731
    path = tiny(vocab="bpe", weight_type="Q4_1", n_heads=4, n_kv_heads=2, d_model=128)
    ids = [(5 * i + 2) % 200 + 1 for i in range(24)]
    runs, threads_seen = {}, {}
    for mode in ("blas", "split"):
        monkeypatch.setenv("LLORCH_BLAS_SPLIT", mode)
        eng = llorch_ref.load(path, backend="numpy", threads=2)
        assert eng.ops is layers and eng.backend.info["blas_split"] == mode
        cache = eng.new_cache()
        prompt = eng.forward(ids, cache)
        after_prompt = blas_threads()
        step = eng.forward([7], cache)
        runs[mode], threads_seen[mode] = (prompt, step), (after_prompt, blas_threads())
    assert threads_seen == {"blas": (2, 2), "split": (2, 1)}
    for a, b in zip(runs["blas"], runs["split"]):
        assert np.array_equal(a, b)
    monkeypatch.setenv("LLORCH_BLAS_SPLIT", "auto")
    eng = llorch_ref.load(path, backend="numpy", threads=2)
    monkeypatch.setattr("llorch_ref.backends.cpu_split.machine_busy_s", lambda: sum(__import__("os").times()[:2]))
    SPLIT.split, SPLIT._last = True, None
    eng.forward([1], eng.new_cache())                # the first look only records where the machine stood
    assert blas_threads() == 1
    SPLIT._last = (SPLIT._last[0] - 1.0, SPLIT._last[1], SPLIT._last[2])
    eng.forward([1], eng.new_cache())                # nobody else used the cores since: BLAS gets its 2 back
    assert SPLIT.split is False and blas_threads() == 2


class OtherProcesses:
    """cpu_split's measures on a simulated machine of 2 usable cores whose busy time rises by `cores` a second
    beside this process's own; measure() takes `looks` measures, each as if 1 s after the one before with
    own_used s of this process's CPU (a process at one thread takes none: it has no threads to fit)."""

    def __init__(self, monkeypatch, cores=2.0):
        import os
        import time

        from llorch_ref.backends import cpu_split

        self.cores = cores
        monkeypatch.setattr(cpu_split, "usable_cores", lambda: 2)
        monkeypatch.setattr(cpu_split, "machine_busy_s",
                            lambda: sum(os.times()[:2]) + self.cores * time.monotonic())

    def measure(self, looks=2, own_used=1.0):
        from llorch_ref.backends.cpu_split import SPLIT

        SPLIT._last = None
        SPLIT.measure()
        for _ in range(looks if SPLIT._last else 0):
            t, busy_s, own = SPLIT._last
            SPLIT._last = (t - 1.0, busy_s - self.cores - own_used, own - own_used)
            SPLIT.measure()


def test_numba_steps_run_on_the_threads_asked_for_in_any_thread_and_on_fewer_while_cores_are_busy(tiny, monkeypatch):
    """numba keeps a thread count per calling thread: a prompt and a step run in another thread (the server's worker)
    run on --threads (1 here), not on NUMBA_NUM_THREADS. While other processes hold the cores (the measure simulated:
    the machine's busy time rising by 2 cores a second beside this process's own, on 2 usable cores) for two
    measures running, a 2-thread engine's one-token steps run on one thread and its prompts on 2; on 2 again once
    the others stop, after a single busy measure (a moment's spinning), or where this process sat idle through the
    window (what the others did then is not now); the logits equal to the bit at every count. Planted: the count
    left as numba has it -> fails."""
    need_backend("numba")
    import threading

    import numba

    from llorch_ref.backends.cpu_split import SPLIT

    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("numba has one thread on this machine")
    path = tiny(vocab="bpe", weight_type="Q4_1", n_heads=4, n_kv_heads=2, d_model=128)
    ids = [(5 * i + 2) % 200 + 1 for i in range(12)]

    def run(eng):
        cache = eng.new_cache()
        prompt = eng.forward(ids, cache)
        after_prompt = numba.get_num_threads()
        step = eng.backend.make_decoder(eng, cache)(7)
        return prompt, step, (after_prompt, numba.get_num_threads())

    one = llorch_ref.load(path, backend="numba", threads=1)
    seen = {}
    worker = threading.Thread(target=lambda: seen.update(before=numba.get_num_threads(), run=run(one)))
    worker.start()
    worker.join()
    assert seen["before"] == numba.config.NUMBA_NUM_THREADS and seen["run"][2] == (1, 1)

    two = llorch_ref.load(path, backend="numba", threads=2)
    idle = run(two)
    assert idle[2] == (2, 2)
    others = OtherProcesses(monkeypatch)
    others.measure()
    busy = run(two)
    assert busy[2] == (2, 1) and SPLIT.others >= 1.5
    for kw, want in ((dict(looks=1), (2, 2)), (dict(own_used=0.0), (2, 2))):
        SPLIT.busy_looks = 0
        others.measure(**kw)
        assert run(two)[2] == want, kw
    others.cores = 0.0
    others.measure()
    assert run(two)[2] == (2, 2)
    for a, b in zip(idle[:2], busy[:2]):
        assert np.array_equal(a, b)
    assert np.array_equal(idle[1], seen["run"][1])


def test_numpy_backend_says_once_that_one_thread_avoids_a_busy_machines_collapse(tiny, monkeypatch, capsys):
    """The oracle's prompts keep their BLAS threads on a busy machine (its results do not follow the load), where
    OpenBLAS's threads waiting on each other ran a prompt 55-65x slower: while other processes hold cores (simulated:
    2 cores' use beside this process's own, at two measures running) a prompt at 2 threads says once that
    --threads 1 avoids it; not at one thread, not on free cores, not twice."""


    path = tiny(vocab="bpe", weight_type="Q4_1", n_heads=4, n_kv_heads=2, d_model=128)
    ids = list(range(1, 13))
    monkeypatch.setenv("LLORCH_BLAS_SPLIT", "auto")
    others = OtherProcesses(monkeypatch)

    def busy_then_prompts(threads, n=2):
        eng = llorch_ref.load(path, backend="numpy", threads=threads)
        others.measure()
        capsys.readouterr()
        for _ in range(n):
            eng.forward(ids, eng.new_cache())
        return capsys.readouterr().err
    err = busy_then_prompts(2)
    assert err.count("warning: other processes hold") == 1 and "--threads 1 avoids it" in err
    assert "warning" not in busy_then_prompts(1)
    others.cores = 0.0
    assert "warning" not in busy_then_prompts(2)


@pytest.mark.parametrize("style", ["adjacent", "neox"])
@pytest.mark.parametrize("rotated", [64, 32])
def test_numba_rope_of_a_prompts_rows_equals_the_references_to_the_bit(style, rotated):
    """rope_rows (a prompt's RoPE on the numba backend) against model.layers.rope: every element the same float,
    all dims rotated and half of them (partial rotary: the rest copied)."""
    need_backend("numba")
    from llorch_ref.backends import numba_kernels as K
    from llorch_ref.model import layers

    rng = np.random.default_rng(7)
    x = rng.standard_normal((37, 5, 64)).astype(np.float32)
    cos, sin = (rng.standard_normal((37, rotated // 2)).astype(np.float32) for _ in range(2))
    out = np.empty_like(x)
    K.rope_rows(x, cos, sin, style == "neox", out)
    np.testing.assert_array_equal(out, layers.rope(np, x, cos, sin, style))


@pytest.mark.parametrize("kernel,first", [("rope_one", ("1B", "q@step1")), ("attend_one", ("4", "kq@step1")),
                                          ("rope_rows", ("1B", "q")), ("rms_norm_rows", ("1", "attn_norm"))])
def test_a_planted_bug_in_a_one_token_kernel_is_caught_at_its_checkpoint(tiny, monkeypatch, kernel, first):
    """The numba kernels of one-token steps are seen by the decode-step rows of run_backend_diff, those that serve a
    prompt's rows too (RoPE's rope_rows, RMSNorm) by the prompt's. Planted: RoPE pairs rotated the other way (neox
    for adjacent), attention scores off by one position (each score read from the next key), RMSNorm with epsilon
    1e-2."""
    need_backend("numba")
    from llorch_ref.backends import numba_kernels as K
    from llorch_ref.harness.run import run_backend_diff

    path = tiny(vocab="bpe", weight_type="Q8_0")
    real = getattr(K, kernel)
    if kernel in ("rope_one", "rope_rows"):
        planted = lambda x, cos, sin, neox, out: real(x, cos, sin, not neox, out)
    elif kernel == "attend_one":
        planted = lambda q, k, v, mask, *rest: real(q, np.roll(k, -1, axis=0), v, mask, *rest)
    else:
        planted = lambda x, w, eps, out: real(x, w, 1e-2, out)
    monkeypatch.setattr(K, kernel, planted)
    res = run_backend_diff(llorch_ref.load(path, backend="numba"), llorch_ref.load(path), n_greedy=4)
    bad = res.first_divergence
    assert bad is not None and (bad["checkpoint"], bad["tensor"]) == first, bad


def test_numba_checkpoints_against_numpy_default_model(default_model):
    need_backend("numba")
    from llorch_ref.harness.run import run_backend_diff

    eng = llorch_ref.load(default_model, backend="numba")
    assert eng.backend.n_matrices == 211              # every Q4_1 matrix and the tied Q8_0 output
    res = run_backend_diff(eng, llorch_ref.load(default_model), n_greedy=32)
    for s in res.summary():
        print(s["checkpoint"], s["name"], s["worst_nmse"], s["worst_max_abs"])
    assert res.first_divergence is None


@pytest.mark.parametrize("qt", list(SCALES_AT))
def test_numba_kernels_match_the_dequantized_product(qt):
    """Every kernel type, two QTensors stacked by rows (72 + 40 rows: padding in the last chunk), one token and
    three, against gguf-py's dequantized weights times x in float64: equal up to summation order; the kernel made
    for the one type (matmul_rows_for, KernelBlocks') equal to the bit to the all-type one (the fused steps')."""
    need_backend("numba")
    from llorch_ref.backends import numba_kernels as K
    from llorch_ref.backends.numba_backend import KernelBlocks

    a, b = random_qtensor(qt, 72, 512, 1), random_qtensor(qt, 40, 512, 2)
    x = np.random.default_rng(3).standard_normal((3, 512)).astype(np.float32)
    deq = np.concatenate([a.dequantize(), b.dequantize()]).astype(np.float64)
    want, scale = x @ deq.T, np.abs(x) @ np.abs(deq).T
    blocks = KernelBlocks([a, b])
    got = blocks.matmul(x)
    assert got.shape == (3, 112)
    assert (np.abs(got - want) <= 1e-6 * scale + 1e-30).all(), float((np.abs(got - want) / scale).max())
    np.testing.assert_array_equal(blocks.matvec(x[1]), got[1])            # each row exactly as alone
    np.testing.assert_array_equal(_one_hot_products(blocks, 512), deq.astype(np.float32))
    for t in (x[1:2], x):                # the one-type kernel KernelBlocks runs, bit for bit the all-type one
        every = np.empty((t.shape[0], 112), np.float32)
        K.matmul_rows(blocks.code, blocks.rows, blocks.n_blocks, t, every)
        np.testing.assert_array_equal(blocks.matmul(t), every)


@pytest.mark.parametrize("qt", ["Q4_0", "Q4_1", "Q5_1", "Q8_0", "Q4_K", "Q6_K", "Q3_K", "Q2_K"])
@pytest.mark.parametrize("k", [512, 2304])
def test_numba_panel_products_of_many_tokens_equal_each_token_alone_to_the_bit(qt, k):
    """Enough tokens for the panels (numba_simd.PANEL_TOKENS: weights decoded once into a float32 panel, then float
    tiles over the tokens; K-quants' one accumulator at a time), with tokens and rows left over past the tiles and
    panels, rows in one chunk (512) and in three (2304: 1024, 1024, 256, the accumulators kept between them): every
    token's products the same to the bit as that token's one-token products (the blocks decoded in the tile itself)
    and as 8 tokens' (the tiles of a few tokens; K-quants' panels), and equal to the dequantized product up to
    summation order."""
    need_backend("numba")
    from llorch_ref.backends import numba_simd as S
    from llorch_ref.backends.numba_backend import KernelBlocks

    assert (k > S.PANEL_CHUNK[0]) == (k == 2304)
    n, t_n = 70, 41                                    # 70 rows: 2 past the last panel of 4; 41 tokens: 2 past the
    assert t_n >= max(S.PANEL_TOKENS)                  # 3-token tiles, 1 past the 4-token ones (K-quants)
    blocks = KernelBlocks([random_qtensor(qt, n, k, 4)])
    x = np.random.default_rng(5).standard_normal((t_n, k)).astype(np.float32)
    got = blocks.matmul(x)
    for t in range(t_n):
        np.testing.assert_array_equal(got[t], blocks.matvec(x[t]), err_msg=f"token {t}")
    np.testing.assert_array_equal(got[:8], blocks.matmul(x[:8]))       # 8 tokens: tiles, or K-quants' panels
    deq = blocks.qts[0].dequantize().astype(np.float64)
    want, scale = x @ deq.T, np.abs(x) @ np.abs(deq).T
    assert (np.abs(got - want) <= 1e-6 * scale + 1e-30).all()


def _one_hot_products(blocks, k, tokens_at_once=(512, 1)):
    """The kernels' weights themselves, whatever the order of their sums: x = e_j gives row r's w[r, j] exactly
    (every other product is a zero) -> [N, K]; all K one-hot tokens in one call, and the first 8 one token a call
    (the one-token tiles decode blocks their own way), which must agree."""
    eye = np.eye(k, dtype=np.float32)
    w = blocks.matmul(eye).T
    for j in range(8):
        np.testing.assert_array_equal(blocks.matvec(eye[j]), w[:, j])
    return w


TABLE_PROBE = """
import sys, numpy as np
sys.path.insert(0, sys.argv[1])
from llorch_ref.testing.blocks import random_qtensor
from llorch_ref.backends import numba_simd
from llorch_ref.backends.numba_backend import KernelBlocks
x = np.random.default_rng(3).standard_normal((5, 512)).astype(np.float32)
eye = np.eye(512, dtype=np.float32)
out = {}
for qt in sys.argv[3:]:
    kb = KernelBlocks([random_qtensor(qt, 24, 512, 7)])
    out[qt], out[qt + "_eye"] = kb.matmul(x), kb.matmul(eye).T
    out[qt + "_eye1"] = np.stack([kb.matvec(eye[j]) for j in range(0, 512, 37)], 1)
np.savez(sys.argv[2], tables=numba_simd.TABLES, words=numba_simd.WORDS, **out)
"""


def test_numba_4bit_lookup_and_conversion_builds_give_the_oracle_weights_to_the_bit(tmp_path):
    """The AVX-512 build looks 4-bit codes' weights up (one vpermps) and reads the codes from 32-bit words (so a
    block's products are summed in an order of their own, LANE_ORDER); any other build converts the codes, read
    in the file's order. Both make each weight the oracle's float: with one-hot tokens (every other product a
    zero) both builds' products are gguf-py's dequantized weights to the bit, all tokens in one call and one
    token a call; with random tokens they agree up to the order of the sums (Q4_0, Q4_1, Q4_K; the other build
    compiled in a child process with AVX-512 turned off)."""
    need_backend("numba")
    import os
    import subprocess
    import sys

    import llvmlite.binding as ll

    ll.initialize_native_target()
    if not ll.get_host_cpu_features().get("avx512f"):
        pytest.skip("this CPU has no AVX-512: only the conversion build runs here")
    feats = ll.get_host_cpu_features()
    off = ",".join(f"{'-' if k.startswith('avx512') or k.startswith('amx') else ('+' if v else '-')}{k}"
                   for k, v in feats.items())
    kinds = ["Q4_0", "Q4_1", "Q4_K"]
    runs = {}
    base = {k: v for k, v in os.environ.items() if k != "NUMBA_CPU_FEATURES"}
    for name, extra in (("lookup", {}), ("conversion", {"NUMBA_CPU_FEATURES": off,
                                                         "NUMBA_CACHE_DIR": str(tmp_path / "cache-conversion")})):
        env = {**base, **extra}                 # the host's build from the usual cache; the other one apart
        subprocess.run([sys.executable, "-c", TABLE_PROBE, os.path.dirname(__file__), str(tmp_path / name), *kinds],
                       env=env, check=True, timeout=600)
        runs[name] = np.load(tmp_path / f"{name}.npz")
    assert bool(runs["lookup"]["tables"]) and not bool(runs["conversion"]["tables"])
    assert bool(runs["lookup"]["words"]) and not bool(runs["conversion"]["words"])
    for qt in kinds:
        want = random_qtensor(qt, 24, 512, 7).dequantize()
        for name, run in runs.items():
            np.testing.assert_array_equal(run[qt + "_eye"], want, err_msg=f"{qt} {name}")
            np.testing.assert_array_equal(run[qt + "_eye1"], want[:, ::37], err_msg=f"{qt} {name}, one token")
        x = np.random.default_rng(3).standard_normal((5, 512)).astype(np.float32)
        scale = np.abs(x) @ np.abs(want.astype(np.float64)).T
        assert (np.abs(runs["lookup"][qt] - runs["conversion"][qt]) <= 1e-6 * scale).all(), qt


STAMP_PROBE = """
import sys
sys.path.insert(0, sys.argv[1])
from llorch_ref.backends import numba_ggml, numba_kernels
for f in (numba_kernels.matmul_rows, numba_kernels.decode_step, numba_ggml.decode_step):
    loc = f._cache._impl.locator
    print(type(loc).__name__, loc.get_cache_path(), repr(loc.get_source_stamp()))
"""


def test_numba_cached_kernels_are_rebuilt_when_any_kernel_source_changes(tmp_path):
    """numba keys a cached function on its own file only: a changed numba_simd.py (the intrinsics numba_kernels'
    and numba_ggml's functions are built from) would load the old kernels. Planted: a copy of the package whose
    numba_simd.py gains one line must give every kernel's cache a new stamp (numba then recompiles), and the
    unchanged copy the same stamp twice; numba_kernels.py and numba_ggml.py alike."""
    need_backend("numba")
    import os
    import shutil
    import subprocess
    import sys

    pkg = tmp_path / "copy"
    shutil.copytree(os.path.dirname(llorch_ref.__file__), pkg / "llorch_ref",
                    ignore=shutil.ignore_patterns("__pycache__"))
    env = {**os.environ, "NUMBA_CACHE_DIR": ""}

    def stamps():
        out = subprocess.run([sys.executable, "-c", STAMP_PROBE, str(pkg)], env=env, check=True, timeout=300,
                             capture_output=True, text=True).stdout.splitlines()
        assert len(out) == 3 and all(line.startswith("KernelInTreeCacheLocator ") for line in out), out
        assert all(str(pkg) in line for line in out), out             # the copy's own cache folder
        return out
    first, again = stamps(), stamps()
    assert first == again
    for name in ("numba_simd.py", "numba_kernels.py", "numba_ggml.py"):
        with open(pkg / "llorch_ref" / "backends" / name, "a") as f:
            f.write("# changed\n")
        changed = stamps()
        assert all(a != b for a, b in zip(first, changed)), name
        first = changed


def test_numba_kernel_modules_take_the_wide_vectors_whichever_is_imported_first():
    """numba reads its CPU features once, at its import: each kernel module, imported first in a fresh process,
    must leave numba with the features numba_wide_vectors gives (512-bit vectors on AVX-512 hosts; on others numba's
    own, where the check holds trivially). Planted by the order it caught: numba_ggml imported numba before
    numba_kernels set the features, and so did numba_backend (which imports numba_ggml first): kernels compiled for
    256-bit vectors under another cache key (9 s)."""
    need_backend("numba")
    import subprocess
    import sys

    def features(first):
        code = f"{first}\nimport numba\nprint(numba.config.CPU_FEATURES)"
        return subprocess.run([sys.executable, "-c", code], check=True, timeout=120, capture_output=True,
                              text=True).stdout.strip()
    want = features("from llorch_ref.backends import numba_wide_vectors\nnumba_wide_vectors()")
    for module in ("numba_simd", "numba_kernels", "numba_ggml", "numba_backend"):
        assert features(f"import llorch_ref.backends.{module}") == want, module


LOAD_PROBE = """
import sys
import numpy as np
from gguf import GGMLQuantizationType as Q, dequantize, quantize
from llorch_ref.backends import numba_cache, numba_kernels as K, numba_simd as S
rng = np.random.default_rng(0)
q = quantize(rng.standard_normal((8, 64)).astype(np.float32), Q.Q4_0)
x, out = rng.standard_normal((1, 64)).astype(np.float32), np.empty((1, 8), np.float32)
K.matmul_rows(S.TYPE_CODE["Q4_0"], np.array([q[r].ctypes.data for r in range(8)], np.int64), 2, x, out)
want = x.astype(np.float64) @ dequantize(q, Q.Q4_0).astype(np.float64).T
print(numba_cache.install(), sum(K.matmul_rows.stats.cache_hits.values()), "numba.np.arraymath" in sys.modules,
      float(np.abs(out - want).max() / np.abs(want).max()))
import numba
print(numba.njit(lambda a: np.median(a))(np.array([3.0, 1.0, 2.0])))       # compiled now: its registries load
"""


def test_numba_kernels_load_from_the_cache_without_numbas_compile_registries():
    """A cached kernel's load skips numba's context refresh (its lowering registries: 0.2-0.3 s of the load) and
    still runs: in a fresh process, matmul_rows comes from the cache (a hit), gives the dequantized product, and
    numba.np.arraymath (a registry only the refresh imports) is not loaded; a function compiled afterwards still
    finds its implementations (np.median's). Planted: numba's own loader (the refresh) imports arraymath."""
    need_backend("numba")
    import subprocess
    import sys

    def probe(numba_load=False):
        back = ("from numba.core import caching\ncaching.Cache.load_overload = caching.Cache.load_overload.numba_load\n"
                "numba_cache.start_threads()\n")         # numba's loader on a cache of any history (the test below)
        code = LOAD_PROBE.replace("K.matmul_rows(", back + "K.matmul_rows(", 1) if numba_load else LOAD_PROBE
        got = subprocess.run([sys.executable, "-c", code], check=True, timeout=300, capture_output=True, text=True)
        return got.stdout.split()
    probe()                                     # compiles and caches the kernel where nothing did before
    installed, hits, registries, err, median = probe()
    assert (installed, hits, registries, median) == ("True", "1", "False", "2.0") and float(err) < 1e-6
    assert probe(numba_load=True)[2] == "True"


MIXED_PROBE = """
import sys
import numpy as np
from gguf import GGMLQuantizationType as Q, dequantize, quantize
from llorch_ref.backends import numba_kernels as K, numba_simd as S
rng = np.random.default_rng(0)
q = quantize(rng.standard_normal((8, 64)).astype(np.float32), Q.Q4_0)
x, out = rng.standard_normal((1, 64)).astype(np.float32), np.empty((1, 8), np.float32)
rows, code = np.array([q[r].ctypes.data for r in range(8)], np.int64), S.TYPE_CODE["Q4_0"]
if sys.argv[1] == "inner":
    K._rows_times(code, rows, 2, K._in_lane_order(code, x), out)
else:
    K.matmul_rows(code, rows, 2, x, out)
want = x.astype(np.float64) @ dequantize(q, Q.Q4_0).astype(np.float64).T
print(sum(K.matmul_rows.stats.cache_hits.values()), float(np.abs(out - want).max() / np.abs(want).max()))
"""


def test_a_kernel_compiled_over_a_cached_parallel_callee_runs_from_the_cache(tmp_path):
    """numba issue 8578: a kernel compiled in a process where its parallel callee came from the cache (matmul_rows
    over _rows_times, the callee compiled alone by an earlier process) is cached without the hook that starts
    numba's threads; loaded from the cache into a fresh process that had not started them, it segfaulted (a tree
    whose cache held such a pair after an edit was reverted). numba_cache starts them at every kernel's cache load.
    Fresh processes on an empty cache folder: the callee alone, then the caller twice (compiled, then loaded): the
    right products every time. Planted: start_threads a no-op -> the last process dies with SIGSEGV."""
    need_backend("numba")
    import os
    import subprocess
    import sys

    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path))

    def probe(part):
        got = subprocess.run([sys.executable, "-c", MIXED_PROBE, part], timeout=300, capture_output=True, text=True,
                             env=env)
        assert got.returncode == 0, (part, got.returncode, got.stderr[-500:])
        hits, err = got.stdout.split()
        assert float(err) < 1e-6
        return int(hits)
    assert [probe("inner"), probe("caller"), probe("caller")] == [0, 0, 1]


RUNTIME_PROBE = """
import numpy as np
from numba.core import codegen
compiled = []
finalize = codegen.CPUCodeLibrary.finalize
codegen.CPUCodeLibrary.finalize = lambda self: compiled.append(self.name) or finalize(self)
from llorch_ref.backends import numba_kernels as K
g = np.linspace(-3, 3, 64).astype(np.float32)
out = np.empty_like(g)
K.silu_mul(g, g, out)
print(sum(K.silu_mul.stats.cache_hits.values()), len(compiled), float(np.abs(out - g / (1 + np.exp(-g)) * g).max()))
"""


def test_numba_runtime_helpers_come_from_the_cache_at_a_cached_start(tmp_path):
    """numba compiles its runtime's helpers (NRT) with LLVM at every start; numba_cache.start_runtime keeps their
    machine code beside the kernels'. Fresh processes on an empty cache folder: the first compiles the kernel, a
    later one the helpers once, and then a start compiles nothing at all (no library finalized) and computes as
    before; a corrupted helpers file is compiled afresh. Planted: the helpers compiled at each start -> fails."""
    need_backend("numba")
    import os
    import subprocess
    import sys

    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path))

    def probe():
        got = subprocess.run([sys.executable, "-c", RUNTIME_PROBE], check=True, timeout=300, capture_output=True,
                             text=True, env=env)
        hits, compiled, err = got.stdout.split()
        assert float(err) < 1e-6
        return int(hits), int(compiled)
    runs = [probe() for _ in range(3)]
    assert runs[0][0] == 0 and runs[0][1] > 0 and runs[2] == (1, 0), runs
    for f in tmp_path.rglob("numba-runtime-*.pkl"):
        f.write_bytes(b"not a pickle")
    assert probe() == (1, 1)


@pytest.mark.parametrize("model", ["tiny-Q4_0", "tiny-Q4_1", "tiny-k_mixed", "default"])
def test_numba_fused_decode_step_equals_the_op_by_op_step(tiny, default_model, model, monkeypatch):
    """The fused one-token step (each layer in one numba call) against the op-by-op forward the checkpoints
    record: the same logits and the same K/V cache, to the bit, over several steps (k_mixed: Q4_K and Q6_K mixed in
    Q/K/V and between layers, as in llama.cpp's Q4_K_M files: the stacked runs). The prompts' several-token
    products pinned to BLAS's threads: on a busy machine cpu_split would cut them into row panels, which some
    OpenBLAS builds multiply with other kernels (cpu_split's docstring), and the two prefills could differ."""
    need_backend("numba")
    monkeypatch.setenv("LLORCH_BLAS_SPLIT", "blas")
    wide = dict(d_model=256, d_ff=512, n_layers=3) if model == "tiny-k_mixed" else {}
    path = default_model if model == "default" else tiny(vocab="bpe", weight_type=model.split("-")[1], **wide)
    eng = llorch_ref.load(path, backend="numba")
    ids = eng.tokenizer.encode("Hello world, the")
    a, b = eng.new_cache(), eng.new_cache()
    for c in (a, b):
        eng.forward(ids, c, rows=[len(ids) - 1])
    fused = eng.backend.make_decoder(eng, a)
    assert eng.backend.info["fused_decode"] and type(fused).__name__ == "FusedDecoder"
    if wide:
        assert {k[0] for k in fused.paths} == {"Q4_K", "Q6_K"} and fused.paths[
            ("Q4_K", "numba kernel (in place), 3 matrices stacked, fused layer step", "1 row")] == 2   # layers 0, 2
    for tok in (5, 17, 3, 99, 5):
        np.testing.assert_array_equal(fused(tok), eng.forward([tok], b, rows=[0]))
    assert a.pos == b.pos
    np.testing.assert_array_equal(a.k[:, :a.pos], b.k[:, :b.pos])
    np.testing.assert_array_equal(a.v[:, :a.pos], b.v[:, :b.pos])


@pytest.mark.parametrize("qt", ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K"])
def test_cuda_blocks_kernels_match_the_dequantized_product(qt):
    """The GPU's blocks: dequantized on the device bit for bit as gguf-py does; one token (GEMV, scales applied once
    per 8 weights) and three (dequantize + cuBLAS) equal to the float64 product up to rounding order; 70 of the
    rows too (a warp's second row past the end), 768 columns (a last pass of one 256-weight piece)."""
    need_backend("cupy")
    import cupy as cp

    from llorch_ref.backends.cuda_blocks import GpuBlocks

    q = random_qtensor(qt, 72, 768, 4)
    g = GpuBlocks.from_qtensor(q, cp)
    np.testing.assert_array_equal(cp.asnumpy(g.dequantize()), q.dequantize())
    deq = q.dequantize().astype(np.float64)
    x = np.random.default_rng(5).standard_normal((3, 768)).astype(np.float32)
    want, scale = x @ deq.T, np.abs(x) @ np.abs(deq).T
    for rows in (x[:1], x):
        got = cp.asnumpy(g.matmul(cp.asarray(rows)))
        assert (np.abs(got - want[:len(rows)]) <= 1e-6 * scale[:len(rows)]).all(), float((np.abs(got - want[:len(rows)]) / scale[:len(rows)]).max())
    got = cp.asnumpy(g[0:70].matmul(cp.asarray(x[:1])))
    assert got.shape == (1, 70) and (np.abs(got - want[:1, :70]) <= 1e-6 * scale[:1, :70]).all()


@pytest.mark.parametrize("layout", [(4, 1, 4), (2, 2, 2), (8, 1, 1)])
def test_cuda_rows_split_over_warps_match_the_dequantized_product(layout):
    """rows_dot with a row over several warps (their sums added through shared memory) or eight octs a lane, the
    layouts tools/gpu_roofline.py times: Q4_K and Q4_1 at 768 columns, 70 rows (a group past the end), against the
    float64 product."""
    need_backend("cupy")
    import cupy as cp

    from llorch_ref.backends import cuda_blocks

    mod = cp.RawModule(code=cuda_blocks.ROWS + cuda_blocks.gemv_source({"q4_k": layout, "q4_1": layout}, "t_{f}"),
                       options=("-std=c++17",))
    x = np.random.default_rng(6).standard_normal((1, 768)).astype(np.float32)
    for qt in ("Q4_K", "Q4_1"):
        q = random_qtensor(qt, 70, 768, 7)
        deq = q.dequantize().astype(np.float64)
        want, scale = x @ deq.T, np.abs(x) @ np.abs(deq).T
        y, per = cp.zeros((1, 70), dtype=cp.float32), cuda_blocks.rows_per_block(layout)
        blocks = cp.asarray(q.blocks)
        mod.get_function(f"t_{qt.lower()}")(((70 + per - 1) // per,), (128,), (blocks, cp.asarray(x), y, cp.int32(70),
                                                                               cp.int32(768), cp.int64(blocks.shape[1])))
        assert (np.abs(cp.asnumpy(y) - want) <= 1e-6 * scale).all(), (qt, layout)


@pytest.mark.parametrize("layout", [(1, 1, 1), (2, 2, 1), (4, 1, 1), (4, 2, 2), (8, 1, 1)])
def test_cuda_q4k_scales_decoded_once_for_several_octs_give_the_same_products_to_the_bit(layout):
    """Q4_K's scales decoded by one lane for four octs and passed by shuffles, its blocks fetched a pass ahead
    (rows_dot's F::SHARES) against one decode an oct and no fetch ahead (LLORCH_Q4K_SHARED=0): the same floats in
    the same operations, so the same products to the bit,
    in each layout (1, 2, 4 and 8 octs a lane, two rows, two warps a row), over 11 super-blocks a row (passes of four
    and a shorter last piece), 70 rows; and equal to the float64 product up to rounding order."""
    need_backend("cupy")
    import cupy as cp

    from llorch_ref.backends import cuda_blocks

    src = cuda_blocks.ROWS + cuda_blocks.gemv_source({"q4_k": layout}, "t_{f}")
    k, n, per = 256 * 11, 70, cuda_blocks.rows_per_block(layout)
    q = random_qtensor("Q4_K", n, k, 8)
    x = np.random.default_rng(9).standard_normal((1, k)).astype(np.float32)
    deq = q.dequantize().astype(np.float64)
    want, scale = x @ deq.T, np.abs(x) @ np.abs(deq).T
    got = {}
    for shared in (1, 0):
        mod = cp.RawModule(code=src, options=("-std=c++17", f"-DLLORCH_Q4K_SHARED={shared}"))
        y, blocks = cp.zeros((1, n), dtype=cp.float32), cp.asarray(q.blocks)
        mod.get_function("t_q4_k")(((n + per - 1) // per,), (128,), (blocks, cp.asarray(x), y, cp.int32(n), cp.int32(k),
                                                                     cp.int64(blocks.shape[1])))
        got[shared] = cp.asnumpy(y)
    np.testing.assert_array_equal(got[1], got[0])
    assert (np.abs(got[1] - want) <= 1e-6 * scale).all(), float((np.abs(got[1] - want) / scale).max())


@pytest.mark.parametrize("weight_type", ["Q4_0", "Q8_0"])
def test_cupy_blocks_checkpoints_against_numpy(tiny, weight_type):
    need_backend("cupy")
    from llorch_ref.harness.run import run_backend_diff

    path = tiny(vocab="bpe", weight_type=weight_type)
    eng = llorch_ref.load(path, backend="cupy", dtype="blocks")
    assert eng.backend.info["blocks_types"] == [weight_type]
    res = run_backend_diff(eng, llorch_ref.load(path), n_greedy=16)
    assert res.first_divergence is None, res.first_divergence


def test_blocks_dtype_is_the_gpu_s(tiny):
    with pytest.raises(ParameterError, match="cupy backend's"):
        llorch_ref.load(tiny(weight_type="Q4_0"), backend="numba", dtype="blocks")


def test_cupy_checkpoints_against_numpy(tiny):
    need_backend("cupy")
    from llorch_ref.harness.run import run_backend_diff

    path = tiny(vocab="bpe")
    for dtype in ("float32", "float16"):
        res = run_backend_diff(llorch_ref.load(path, backend="cupy", dtype=dtype), llorch_ref.load(path), n_greedy=16)
        assert res.first_divergence is None, (dtype, res.first_divergence)


@pytest.mark.parametrize("dtype,weights,prompt", [("float16", "F32", 5), ("float16", "F32", 252),
                                                   ("float16", "F32", 300), ("blocks", "Q4_0", 5),
                                                   ("blocks", "Q4_1", 300), ("blocks", "Q8_0", 5),
                                                   ("blocks", "mixed", 5), ("blocks", "mixed_qkv", 5)])
def test_cupy_fused_decode_step_matches_the_op_by_op_step(tiny, monkeypatch, dtype, weights, prompt):
    """The decode step in five kernels a layer (cuda_fused.FusedStep) against the op-by-op step, eight greedy
    steps after a prompt (graph replays included): the same tokens, logits equal up to summation order. float16
    weights; GGUF blocks (--dtype blocks; mixed: float32 attention matrices beside Q8_0 blocks; mixed_qkv: Q/K in
    Q8_0 and V in Q4_0, three Q/K/V launches). Prompts of 5, 252
    and 300 tokens: attention in one block a head, crossing into chunks of 128 positions (three) between two
    replays of the graph, and over three chunks combined."""
    need_backend("cupy")
    import cupy as cp

    path = tiny(vocab="bpe", n_layers=3, context_length=512, weight_type=weights)
    got = {}
    for fused in ("1", "0"):
        monkeypatch.setenv("LLORCH_CUDA_FUSED", fused)
        eng = llorch_ref.load(path, backend="cupy", dtype=dtype)
        cache, ids = eng.new_cache(), [(7 * i + 3) % 200 + 1 for i in range(prompt)]
        tok = int(cp.asnumpy(eng.forward(ids, cache, rows=[len(ids) - 1])).argmax())
        dec = eng.backend.make_decoder(eng, cache)
        assert eng.backend.info["fused_decode"] is (fused == "1")
        if fused == "1":
            assert eng.backend.info["cuda_pdl"] is True       # programmatic dependent launch in use
        rows, be = [], eng.backend
        for i in range(8):
            out = dec(tok)
            assert cache.pos == int(cache.pos_dev[0]) == prompt + i + 1      # host and device positions agree
            rows.append(cp.asnumpy(out).copy())
            tok = int(rows[-1].argmax())
            assert (out.data.ptr in be.step_argmax) is (i >= 1)        # replays carry the argmax they took
            assert be.argmax(out[-1]) == tok and not be.step_argmax
        got[fused] = np.concatenate(rows)
    a, b = got["1"], got["0"]
    nmse = float(((a - b) ** 2).sum() / (b ** 2).sum())
    print(f"fused vs op-by-op: NMSE {nmse:.2e}, max abs {np.abs(a - b).max():.2e}")
    np.testing.assert_array_equal(a.argmax(-1), b.argmax(-1))
    assert nmse < (1e-8 if dtype == "float16" else 1e-10)


@pytest.mark.parametrize("dtype,weights,prompt", [("float16", "F32", 300), ("blocks", "mixed_qkv", 5),
                                                   ("blocks", "Q4_1", 5)])
def test_cupy_fused_step_in_the_planar_layout_gives_the_same_logits_to_the_bit(tiny, monkeypatch, dtype, weights,
                                                                                prompt):
    """A fused step of formats in cuda_fused.LAYOUT_PLANAR keeps the vectors its products read in the planar layout
    (rows_dot's PLANAR: each oct's first four floats in one plane, the last four in another): the same floats in
    the same operations as the natural layout, so eight greedy steps give the same logits to the bit. Every format
    made planar here (float16 over three chunks of attention; Q/K/V in two block types as three launches; Q4_1,
    whose offset sums read x too), against LLORCH_CUDA_PLANAR=0."""
    need_backend("cupy")
    import cupy as cp

    from llorch_ref.backends import cuda_fused

    path = tiny(vocab="bpe", n_layers=3, context_length=512, weight_type=weights)
    got = {}
    try:
        monkeypatch.setattr(cuda_fused, "LAYOUT_PLANAR", {f: dict(r) for f, r in cuda_fused.LAYOUT.items()})
        for planar in (True, False):
            monkeypatch.setenv("LLORCH_CUDA_PLANAR", "1" if planar else "0")
            cuda_fused._MOD.clear()
            eng = llorch_ref.load(path, backend="cupy", dtype=dtype)
            cache, ids = eng.new_cache(), [(5 * i + 2) % 200 + 1 for i in range(prompt)]
            tok = int(cp.asnumpy(eng.forward(ids, cache, rows=[len(ids) - 1])).argmax())
            dec = eng.backend.make_decoder(eng, cache)
            assert eng.backend.info["fused_decode"] and eng.backend.info["fused_planar"] is planar
            rows = []
            for _ in range(8):
                rows.append(cp.asnumpy(dec(tok)).copy())
                tok = int(rows[-1].argmax())
            got[planar] = np.concatenate(rows)
    finally:
        cuda_fused._MOD.clear()                 # the next test compiles the default layout again
    np.testing.assert_array_equal(got[True], got[False])


@pytest.mark.parametrize("fused", ["1", "0"])
def test_cupy_generation_stops_at_a_full_context_with_its_positions_agreeing(tiny, monkeypatch, fused):
    """Greedy generation on the card until the context is full (40 positions, a 5-token prompt): 36 tokens, stop
    reason context_full, and the host's and the device's positions both at 40 at the end: the fused float16 step's
    first (eager) step once left the host position one behind, so the last step wrote one row past the cache. The
    float32 tokens (op-by-op step, captured) equal the numpy oracle's."""
    need_backend("cupy")
    import cupy as cp

    from llorch_ref.engine import GenerationResult

    monkeypatch.setenv("LLORCH_CUDA_FUSED", fused)
    path = tiny(vocab="bpe", n_layers=2, context_length=64)
    prompt = [1, 5, 9, 14, 3]
    ref = list(llorch_ref.load(path, backend="numpy", n_ctx=40).generate_ids(prompt, max_tokens=100, ignore_eos=True))
    for dtype in ("float16", "float32"):
        eng = llorch_ref.load(path, backend="cupy", dtype=dtype, n_ctx=40)
        res = GenerationResult()
        toks = list(eng.generate_ids(prompt, max_tokens=100, ignore_eos=True, result=res))
        assert res.stop_reason == "context_full" and len(toks) == 36
        cache, _ = eng._spare[0]                            # the finished request's pair, before any reset
        assert cache.pos == int(cp.asnumpy(cache.pos_dev)[0]) == 40
        assert eng.backend.info["fused_decode"] is (fused == "1" and dtype == "float16")
        if dtype == "float32":
            assert toks == ref


@pytest.mark.parametrize("dtype,weights", [("float16", "F32"), ("blocks", "Q8_0"), ("float32", "F32")])
def test_cupy_chained_greedy_steps_give_the_tokens_of_one_step_at_a_time(tiny, monkeypatch, dtype, weights):
    """Plain greedy generation chains the captured steps on the card (GraphDecoder.chained: each step's argmax is
    the next one's input, one step launched ahead of the token the host reads): the same tokens as one step at a
    time (LLORCH_CUDA_CHAIN=0), for a long request and a short one; after each, the host's and the device's
    positions agree on the steps read (the step launched ahead undone), and the next request on the reused cache
    and decoder gives the same tokens again. float16 and float32 (the fused and the op-by-op steps),
    Q8_0 blocks (a planar step)."""
    need_backend("cupy")
    import cupy as cp

    from llorch_ref.engine import GenerationResult

    path = tiny(vocab="bpe", n_layers=2, context_length=256, weight_type=weights)
    prompt = [3, 17, 4, 90, 12, 6]
    got = {}
    for chain in ("1", "0"):
        monkeypatch.setenv("LLORCH_CUDA_CHAIN", chain)
        eng = llorch_ref.load(path, backend="cupy", dtype=dtype, n_ctx=256)
        runs = []
        for n in (40, 7, 40):
            res = GenerationResult()
            runs.append(list(eng.generate_ids(prompt, max_tokens=n, ignore_eos=True, result=res)))
            cache, dec = eng._spare[0]
            # one step at a time ends with the last token's step run (its logits unused); chained, with the steps
            # whose token was read (the last token's step was the one ahead, undone)
            assert cache.pos == int(cp.asnumpy(cache.pos_dev)[0]) == len(prompt) + n - (chain == "1")
        assert runs[2] == runs[0] and runs[1] == runs[0][:7]
        got[chain] = runs[0]
        assert dec.graph is not None
    assert got["1"] == got["0"]


def test_unavailable_or_unknown_backend_is_a_clear_error(tiny, monkeypatch):
    with pytest.raises(ParameterError, match="not one of"):
        llorch_ref.load(tiny(), backend="tpu")
    with pytest.raises(ParameterError, match="float32 only"):
        llorch_ref.load(tiny(), backend="numpy", dtype="float16")
    monkeypatch.setenv("LLORCH_BACKEND", "numba")
    try:
        assert llorch_ref.load(tiny()).backend.name == "numba"
    except ParameterError as e:
        assert "numba" in str(e)


@pytest.mark.parametrize("n_pos,window", [(1, 0), (13, 0), (40, 0), (40, 8)])
def test_numba_decode_attention_matches_the_reference(n_pos, window):
    """The one-token attention kernel against layers.attention: GQA (6 heads on 2 KV heads), Hd 24, a
    causal or sliding-window mask; kq and probs are returned for the harness."""
    need_backend("numba")
    from llorch_ref.backends.numba_backend import NumbaBackend
    from llorch_ref.model import layers as L
    from llorch_ref.model.cache import visible_mask

    rng = np.random.default_rng(n_pos)
    q = rng.standard_normal((1, 6, 24)).astype(np.float32)
    k, v = (rng.standard_normal((n_pos, 2, 24)).astype(np.float32) for _ in range(2))
    mask = visible_mask(np, np.array([[n_pos - 1]]), np.arange(n_pos)[None, :], window)
    kv_head = L.kv_head_of(np, 6, 2)
    ops = NumbaBackend(threads=2).make_ops(L)
    want = L.attention(np, q, k, v, mask, 0.2, kv_head)
    got = ops.attention(np, q, k, v, mask, 0.2, kv_head)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == np.float32
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-6)
    # the parallel kernel (models whose products all run on kernels) gives the same bits as the serial one
    from llorch_ref.backends import numba_kernels as K
    outs = []
    for attend in (K.attend_one, K.attend_one_serial):
        o, kq, pr = np.empty((6, 24), np.float32), np.empty((6, n_pos), np.float32), np.empty((6, n_pos), np.float32)
        attend(np.ascontiguousarray(q[0]), k, v, mask[0], 0.2, kv_head, o, kq, pr)
        outs.append((o, kq, pr))
    assert all(np.array_equal(a, b) for a, b in zip(*outs))
    # a planted bug: every query head reading KV head 0 (no GQA repeat) must not pass
    bad = ops.attention(np, q, k, v, mask, 0.2, np.zeros(6, dtype=kv_head.dtype))
    assert not np.allclose(bad[0], want[0], rtol=2e-5, atol=2e-6)


def test_cupy_argmax_answers_as_numpy_on_ties_and_nan():
    need_backend("cupy")
    import cupy as cp

    from llorch_ref.backends import get_backend

    be = get_backend("cupy")
    x = np.zeros(70000, np.float32)
    x[[5, 60000]] = 3.0
    assert be.argmax(cp.asarray(x)) == int(np.argmax(x)) == 5
    x[[900, 40000]] = np.nan
    assert be.argmax(cp.asarray(x)) == int(np.argmax(x)) == 900


def test_cupy_half_products_against_float64_on_float16_inputs():
    """cuda_half: gemmEx and the batched attention products against NumPy in float64 on the same float16-rounded
    inputs (GQA: 6 query heads on 2 KV heads, a cached prefix and a causal mask): float32 accumulation error only."""
    need_backend("cupy")
    import cupy as cp

    from llorch_ref.backends.cuda_half import half_attention, half_gemm
    from llorch_ref.backends.cupy_backend import _kernels
    from llorch_ref.model.cache import visible_mask

    rng = np.random.default_rng(11)
    r16 = lambda a: a.astype(np.float16).astype(np.float64)                     # noqa: E731
    x, w = rng.standard_normal((37, 256)).astype(np.float32), rng.standard_normal((96, 256)).astype(np.float16)
    y = cp.asnumpy(half_gemm(cp, cp.asarray(x), cp.asarray(w)))
    want = r16(x) @ w.astype(np.float64).T
    assert y.dtype == np.float32 and np.abs(y - want).max() <= 1e-5 * np.abs(want).max()
    for h, kv in ((6, 2), (4, 4)):                   # grouped heads (transposed after), one a KV head (in place)
        t, s, hd = 21, 29, 64
        q = rng.standard_normal((t, h, hd)).astype(np.float32)
        k, v = rng.standard_normal((s, kv, hd)).astype(np.float32), rng.standard_normal((s, kv, hd)).astype(np.float32)
        mask = visible_mask(np, np.arange(s - t, s)[:, None], np.arange(s)[None, :]).astype(np.float32)
        got = half_attention(cp, cp.asarray(q), cp.asarray(k), cp.asarray(v), cp.asarray(mask), 0.125,
                             _kernels(cp)["softmax_rows_f16"])
        assert got.dtype == cp.float16 and got.shape == (t, h * hd)
        got = cp.asnumpy(got).astype(np.float64)
        g = h // kv
        sc = np.einsum("thd,shd->hts", r16(q), r16(k)[:, np.arange(h) // g]) * 0.125 + mask
        p = np.exp(sc - sc.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        want = np.einsum("hts,shd->thd", r16(p), r16(v)[:, np.arange(h) // g]).reshape(t, h * hd)
        assert np.abs(got - want).max() <= 2e-3 * np.abs(want).max()           # p's float16 rounding differs
        bad = cp.asnumpy(half_attention(cp, cp.asarray(q), cp.asarray(k[:, ::-1].copy()), cp.asarray(v),
                                        cp.asarray(mask), 0.125, _kernels(cp)["softmax_rows_f16"]))
        assert np.abs(bad - want).max() > 1e-2 * np.abs(want).max()             # planted: the KV heads swapped


def test_cupy_fused_norm_and_gated_activation_kernels():
    """The kernels of the unwatched prefill: add_rms_norm (x + a and its RMSNorm in one pass) equal to the bit to
    CuPy's x + a then the rms_norm kernel, its float16 form that result rounded; glu_f16 (read from the two halves of
    a stacked gate/up product) glu_f32's result rounded to float16, gelu within one float16 step, and glu_f32 the
    reference's silu and gelu within 1e-6 of the largest (CUDA's expf and tanhf against NumPy's). Planted: the sum
    left out of the norm, gate and up swapped."""
    need_backend("cupy")
    import cupy as cp

    from llorch_ref.backends.cupy_backend import _kernels
    from llorch_ref.model import layers as L

    K, rng = _kernels(cp), np.random.default_rng(5)
    t, n = 7, 576
    x, a = (cp.asarray(rng.standard_normal((t, n)).astype(np.float32) * 3) for _ in range(2))
    w = cp.asarray(rng.standard_normal(n).astype(np.float32))
    ref_s = x + a
    ref_y = cp.empty_like(x)
    K["rms_norm_rows"]((t,), (256,), (ref_s, w, ref_y, np.int32(n), np.float32(1e-5)))
    for name, dt in (("add_rms_norm_f32", cp.float32), ("add_rms_norm_f16", cp.float16)):
        s, y = cp.empty_like(x), cp.empty((t, n), dtype=dt)
        K[name]((t,), (256,), (x, a, s, w, y, np.int32(n), np.float32(1e-5)))
        assert cp.array_equal(s, ref_s) and cp.array_equal(y, ref_y.astype(dt))
    y16 = cp.empty((t, n), dtype=cp.float16)
    K["rms_norm_rows_f16"]((t,), (256,), (x, w, y16, np.int32(n), np.float32(1e-5)))
    assert not cp.array_equal(y16, ref_y.astype(cp.float16))                   # planted: x alone, without a
    nf = 320
    gu = cp.asarray(rng.standard_normal((t, 2 * nf)).astype(np.float32) * 4)
    g, u = gu[:, :nf], gu[:, nf:]
    for gelu in (0, 1):
        h = cp.empty((t, nf), dtype=cp.float16)
        K["glu_f16"](((t * nf + 255) // 256,), (256,), (g, u, np.int64(2 * nf), h, np.int32(nf), np.int64(t * nf),
                                                         np.int32(gelu)))
        want = cp.empty((t, nf), dtype=cp.float32)
        K["glu_f32"](((t * nf + 255) // 256,), (256,), (g, u, np.int64(2 * nf), want, np.int32(nf), np.int64(t * nf),
                                                         np.int32(gelu)))
        gn, un = cp.asnumpy(g), cp.asnumpy(u)
        ref = (L.gelu_tanh(np, gn) if gelu else L.silu(np, gn)) * un
        assert np.abs(cp.asnumpy(want) - ref).max() <= 1e-6 * np.abs(ref).max()
        step = np.abs(cp.asnumpy(want.astype(cp.float16)).astype(np.float32)) * 2.0 ** -10
        diff = np.abs(cp.asnumpy(h).astype(np.float32) - cp.asnumpy(want.astype(cp.float16)).astype(np.float32))
        assert (diff == 0).all() if not gelu else (diff <= step + 1e-7).all()
        swapped = cp.empty_like(h)
        K["glu_f16"](((t * nf + 255) // 256,), (256,), (u, g, np.int64(2 * nf), swapped, np.int32(nf),
                                                         np.int64(t * nf), np.int32(gelu)))
        assert np.abs(cp.asnumpy(swapped).astype(np.float32) - cp.asnumpy(want)).max() > 0.1


@pytest.mark.parametrize("d_model,kv_dtype,kv_heads", [(128, "float32", 2), (256, "float16", 2), (128, "float16", 4)])
def test_cupy_generation_prefill_within_the_float16_band(tiny, d_model, kv_dtype, kv_heads):
    """float16 weights: generation's prefill (no recorder: RoPE and the cache write in one kernel, half-precision
    attention products, the residual adds fused with the next norms, float16 activations into the products) against
    the recorded path, head dims 32 and 64, grouped KV heads or one query head a KV head, a prompt in two parts (the
    second attends to a cached prefix): logits and the K/V cache within the cupy:float16 band, layer 0's cache
    (before any attention difference) equal to the bit; float32 weights (fused adds and norms only) equal to the bit."""
    need_backend("cupy")
    import cupy as cp

    path = tiny(vocab="bpe", d_model=d_model, n_heads=4, n_kv_heads=kv_heads)
    ids = [(7 * i + 3) % 200 + 1 for i in range(53)]
    for dtype in ("float16", "float32"):
        eng = llorch_ref.load(path, backend="cupy", dtype=dtype, kv_dtype=kv_dtype)
        out, caches = {}, {}
        for watched in (False, True):
            record = (lambda name, layer, arr: None) if watched else None
            cache = eng.new_cache()
            a = eng.forward(ids[:20], cache, record=record)
            b = eng.forward(ids[20:], cache, record=record)
            out[watched] = np.concatenate([cp.asnumpy(a), cp.asnumpy(b)])
            caches[watched] = (cp.asnumpy(cache.k[:, :cache.pos]), cp.asnumpy(cache.v[:, :cache.pos]))
        for fast_kv, ref_kv in zip(caches[False], caches[True]):
            assert np.array_equal(fast_kv[0], ref_kv[0])    # layer 0: RoPE and the write alone; later layers
            a, b = fast_kv.astype(np.float64), ref_kv.astype(np.float64)          # see attention's differences
            e = float(((a - b) ** 2).sum() / (b ** 2).sum())
            assert e < 1e-3 if dtype == "float16" else e == 0.0
        fast, ref = out[False], out[True]
        nmse = float(((fast - ref) ** 2).sum() / (ref ** 2).sum())
        print(f"{dtype}: unrecorded vs recorded prefill NMSE {nmse:.2e}, max abs {np.abs(fast - ref).max():.2e}")
        if dtype == "float16":
            assert 0.0 < nmse < 1e-3                     # 0 would mean the half path never ran
        else:
            assert nmse == 0.0
