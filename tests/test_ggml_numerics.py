"""numerics='ggml': llama.cpp's CPU arithmetic reproduced in NumPy, checked bit for bit against llama.cpp."""
from __future__ import annotations

import numpy as np
import pytest
from llorch_test_helpers import need_backend

import llorch_ref
from llorch_ref.harness.metrics import compare
from llorch_ref.numerics import ggml_cpu

PROMPT = "Once upon a time, there was a little"
IDS = [1, 17, 5, 99, 42, 7, 64, 3, 120, 11]


def test_q8_0_activation_quantization_matches_gguf_quantizer():
    import gguf

    rng = np.random.default_rng(0)
    x = (rng.standard_normal((4, 256)) * rng.uniform(0.01, 10, (4, 1))).astype(np.float32)
    q, d, _ = ggml_cpu.quantize_q8(x, with_sum=False)
    ref = gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q8_0).reshape(4, 8, 34)
    np.testing.assert_array_equal(d, ref[..., :2].copy().view(np.float16)[..., 0].astype(np.float32))
    np.testing.assert_array_equal(q.astype(np.int8), ref[..., 2:].view(np.int8))


def test_q8_1_sum_field():
    x = np.linspace(-3, 5, 64, dtype=np.float32)[None]
    q, d, s = ggml_cpu.quantize_q8(x, with_sum=True)
    np.testing.assert_allclose(s, (d * q.sum(-1)).astype(np.float16).astype(np.float32), rtol=1e-3)


@pytest.mark.parametrize("qt", ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"])
def test_numba_k_quant_products_equal_the_numpy_emulation(qt):
    """numba_ggml.kquant_rows against ggml_cpu.KQuantMatrix, bit for bit: random super-blocks (every code and
    scale bit pattern drawn), one token and several, activations of very different scales, a row of zeros.
    Planted: the activations' first block negated (differs)."""
    need_backend("numba")
    from llorch_ref.backends.numba_backend import GgmlKQuantMatrix
    from llorch_ref.testing.blocks import random_qtensor

    qtensor = random_qtensor(qt, 37, 768, 5)                           # 37 rows, 3 super-blocks
    rng = np.random.default_rng(9)
    x = (rng.standard_normal((6, 768)) * np.array([[1e-4], [1], [50], [1], [3e3], [0]])).astype(np.float32)
    want, fast = ggml_cpu.KQuantMatrix(qtensor).matmul(x), GgmlKQuantMatrix(qtensor)
    for t in (1, 6):
        assert np.array_equal(fast.matmul(x[:t]), want[:t])
    bad = x.copy()
    bad[:, :256] *= -1
    assert not np.array_equal(fast.matmul(bad), want)


@pytest.mark.parametrize("qt", ["Q4_K", "Q6_K", "Q5_0"])
def test_fused_step_products_equal_the_matrices(qt):
    """numba_ggml.product, the fused decode step's product (K-quants by kquant_rows on row addresses, legacy types by
    ggml_rows), gives the bits of the weight's own kernel matrix, one token."""
    need_backend("numba")
    from llorch_ref.backends import numba_ggml as G
    from llorch_ref.backends import numba_simd as S
    from llorch_ref.backends.numba_backend import GgmlKernelMatrix, GgmlKQuantMatrix
    from llorch_ref.testing.blocks import random_qtensor

    m = (GgmlKQuantMatrix if qt.endswith("_K") else GgmlKernelMatrix)(random_qtensor(qt, 19, 512, 2))
    x = np.random.default_rng(4).standard_normal(512).astype(np.float32) * 3
    got = G.product(S.TYPE_CODE[qt], m.rows, 512 // m.block, x)
    assert np.array_equal(got, m.matmul(x[None])[0])
    assert not np.array_equal(G.product(S.TYPE_CODE[qt], m.rows[::-1].copy(), 512 // m.block, x), got)


@pytest.mark.parametrize("qt", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
def test_numba_ggml_products_equal_the_numpy_emulation(qt):
    """The numba kernel against ggml_cpu.LegacyQuantMatrix, bit for bit: one row and several, activations of very
    different scales, a row of zeros (its Q8 scale is 0)."""
    need_backend("numba")
    import gguf

    from llorch_ref.backends.numba_backend import GgmlKernelMatrix
    from llorch_ref.model.qtensor import QTensor

    rng = np.random.default_rng(3)
    w = rng.standard_normal((201, 256)).astype(np.float32)               # 201 rows: tiles of 4 and one left
    qtensor = QTensor(qt, w.shape, gguf.quants.quantize(w, gguf.GGMLQuantizationType[qt]))
    qm = ggml_cpu.LegacyQuantMatrix(qtensor)
    fast = GgmlKernelMatrix(qtensor)
    x = (rng.standard_normal((6, 256)) * np.array([[1e-4], [1], [50], [1], [3e3], [0]])).astype(np.float32)
    for rows in (x[:1], x):
        assert np.array_equal(fast.matmul(rows), qm.matmul(rows))
    assert not np.array_equal(fast.matmul(x[1:2]), x[1:2] @ gguf.quants.dequantize(
        gguf.quants.quantize(w, gguf.GGMLQuantizationType[qt]), gguf.GGMLQuantizationType[qt]).T)


@pytest.mark.parametrize("qt", ["F32", "F16"])
@pytest.mark.parametrize("lanes", [8, 16])
def test_numba_float_products_equal_the_numpy_emulation(qt, lanes):
    """numba_ggml.float_rows (GgmlFloatMatrix) against ggml_cpu.FloatMatrix, bit for bit: one row (vec_dot) and
    several (tinyBLAS), K a multiple of 4 lanes and not (vec_dot's leftovers), N not a multiple of 4 (tinyBLAS
    declines), activations of very different scales; the two paths swapped must not pass."""
    need_backend("numba")
    from llorch_ref.backends import numba_ggml as G
    from llorch_ref.backends.numba_backend import GgmlFloatMatrix

    rng = np.random.default_rng(5)
    scales = np.array([[1e-4], [1], [50], [1], [3e3]])
    for n, k in ((12, 256), (10, 256), (12, 272), (9, 200)):
        w = rng.standard_normal((n, k)).astype(np.float16 if qt == "F16" else np.float32).astype(np.float32)
        fm = ggml_cpu.FloatMatrix(w, qt, lanes)
        fast = GgmlFloatMatrix(fm)
        x = (rng.standard_normal((5, k)) * scales).astype(np.float32)
        for rows in (x[:1], x):
            assert np.array_equal(fast.matmul(rows), fm.matmul(rows)), (n, k, len(rows))
    x, w, swapped = (rng.standard_normal(s).astype(np.float32) for s in ((5, 256), (12, 256), (5, 12)))
    G.float_rows(x, w, False, lanes, swapped)                               # vec_dot where tinyBLAS runs
    assert not np.array_equal(swapped, ggml_cpu.FloatMatrix(w, "F32", lanes).matmul(x))


BUILD_PROBE = """
import json, sys
import numpy as np
import numba
sys.path.insert(0, sys.argv[1])
from llorch_ref.backends import numba_kernels as K, numba_simd as S
from llorch_ref.backends.numba_backend import GgmlKernelMatrix
f = K.ggml_rows
fresh = numba.njit(**{k: v for k, v in f.targetoptions.items() if k not in ("cache", "nopython")})(f.py_func)
K.ggml_rows = fresh                             # compiled now, for this build: its assembly can be read
data = np.load(sys.argv[2])
out = {}
from llorch_ref.backends.numba_backend import GgmlKQuantMatrix
from llorch_ref.model.qtensor import QTensor
for qt in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"):
    cls = GgmlKQuantMatrix if qt.endswith("_K") else GgmlKernelMatrix
    x = data["xk"] if qt.endswith("_K") else data["x"]
    out[qt] = cls(QTensor(qt, tuple(data[qt + "_shape"]), data[qt])).matmul(x)
asm = "\\n".join(fresh.inspect_asm().values())
np.savez(sys.argv[3], **out)
print(json.dumps({"pairs": S.PAIRS, "vnni": S.VNNI, "vpdpbusd": "vpdpbusd" in asm, "vpmaddubsw": "vpmaddubsw" in asm}))
"""


def test_numba_ggml_products_are_bit_equal_in_each_instruction_set_build(tmp_path):
    """The integer sums of ggml's legacy and K-quant products come from bytes: vpdpbusd where the CPU has VNNI
    (AVX-VNNI or AVX-512 VNNI), vpmaddubsw and vpmaddwd on AVX2 without it, 32-bit products below AVX2. Each build
    numba can make here (the host's, without VNNI, without AVX2: NUMBA_CPU_FEATURES) compiles ggml_rows afresh (and
    kquant_rows), and its products of the five legacy types and Q4_K, Q5_K, Q6_K equal the NumPy emulation's bit for
    bit; the instruction ggml_rows uses is read from its assembly."""
    need_backend("numba")
    import json
    import os
    import subprocess
    import sys

    import gguf
    import llvmlite.binding as ll

    from llorch_ref.model.qtensor import QTensor
    from llorch_ref.testing.blocks import random_qtensor

    rng = np.random.default_rng(11)
    w = rng.standard_normal((37, 128)).astype(np.float32)
    x = (rng.standard_normal((5, 128)) * np.array([[1e-3], [1], [40], [7e2], [0]])).astype(np.float32)
    data, want = {"x": x}, {}
    for qt in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"):
        blocks = gguf.quants.quantize(w, gguf.GGMLQuantizationType[qt])
        data[qt], data[qt + "_shape"] = blocks, np.array(w.shape)
        want[qt] = ggml_cpu.LegacyQuantMatrix(QTensor(qt, w.shape, blocks)).matmul(x)
    data["xk"] = np.concatenate([x, x[:, ::-1]], axis=1)                   # 256 wide: one super-block
    for qt in ("Q4_K", "Q5_K", "Q6_K"):
        qtensor = random_qtensor(qt, 21, 256, 4)
        data[qt], data[qt + "_shape"] = qtensor.blocks, np.array(qtensor.shape)
        want[qt] = ggml_cpu.KQuantMatrix(qtensor).matmul(data["xk"])
    np.savez(tmp_path / "in.npz", **data)
    ll.initialize_native_target()
    feats = ll.get_host_cpu_features()

    def without(drop):
        return ",".join(f"{'-' if drop(k) or not v else '+'}{k}" for k, v in feats.items())
    builds = {"host": None, "no VNNI": without(lambda k: "vnni" in k)}
    if feats.get("avx2"):
        builds["no AVX2"] = without(lambda k: k.startswith(("avx2", "avx512", "avxvnni", "amx")))
    seen, runs = {}, {}
    for i, (name, features) in enumerate(builds.items()):        # side by side: each compile is one thread
        env = {k: v for k, v in os.environ.items() if k != "NUMBA_CPU_FEATURES"}
        if features:
            env.update(NUMBA_CPU_FEATURES=features, NUMBA_CACHE_DIR=str(tmp_path / f"cache{i}"))
        runs[name] = subprocess.Popen([sys.executable, "-c", BUILD_PROBE,
                                       os.path.dirname(os.path.dirname(llorch_ref.__file__)), str(tmp_path / "in.npz"),
                                       str(tmp_path / f"{i}.npz")],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for i, (name, p) in enumerate(runs.items()):
            out, err = p.communicate(timeout=600)
            assert p.returncode == 0, err[-2000:]
            seen[name] = json.loads(out.strip().splitlines()[-1])
            got = np.load(tmp_path / f"{i}.npz")
            for qt, v in want.items():
                assert np.array_equal(got[qt], v), (name, qt)
            info = seen[name]
            assert info["vpdpbusd"] == info["vnni"] and info["vpmaddubsw"] == (info["pairs"] and not info["vnni"]), (
                name, info)
    finally:
        for p in runs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    assert not seen["no VNNI"]["vnni"] and seen["host"]["vnni"] == bool(feats.get("avxvnni") or (
        feats.get("avx512vnni") and feats.get("avx512vl")))
    if "no AVX2" in seen:
        assert not seen["no AVX2"]["pairs"]


def test_v_expf_is_within_two_ulp_of_exp():
    x = np.linspace(-87, 88, 100001, dtype=np.float32)
    got, want = ggml_cpu.v_expf(x), np.exp(x.astype(np.float64))
    ulp = np.spacing(want.astype(np.float32)).astype(np.float64)
    assert (np.abs(got - want) / ulp).max() < 2.0
    assert ggml_cpu.v_expf(np.array([-np.inf], np.float32))[0] == 0.0


@pytest.mark.parametrize("wt", ["F32", "F16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "mixed"])
@pytest.mark.parametrize("kv", ["float32", "float16"])
@pytest.mark.parametrize("backend", ["numpy", "numba"])
def test_tiny_models_bit_identical_to_llamacpp(tiny, llamacpp, wt, kv, backend):
    """Prefill (every row), then single-token decode steps: every logit equal to llama.cpp's, bit for bit.
    numba: the legacy-quant products run its kernel (the rest stays the NumPy emulation)."""
    from llorch_ref.references.llamacpp import LlamaCpp

    if backend == "numba":
        need_backend("numba")
    path = tiny(vocab="none", weight_type=wt)
    eng = llorch_ref.load(path, numerics="ggml", kv_dtype=kv, backend=backend)
    ref = LlamaCpp(path, n_ctx=128, kv_dtype=kv)
    m = compare(eng.logits(IDS), ref.eval(IDS))
    assert m["max_abs"] == 0.0, m
    cache = eng.new_cache()
    eng.forward(IDS, cache, rows=[len(IDS) - 1])
    lc = ref.llama_cpp
    lc.llama_memory_clear(lc.llama_get_memory(ref.ctx), True)
    ref._decode(IDS, 0, None, all_logits=False)
    for i, tok in enumerate([5, 9, 33, 2, 77]):
        ours = eng.forward([tok], cache, rows=[0])
        theirs = ref._decode([tok], len(IDS) + i, None, all_logits=False)
        assert np.array_equal(ours, theirs), f"decode step {i}"
    ref.close()


@pytest.mark.parametrize("kv", ["float32", "float16"])
def test_default_model_logits_identical_and_exact_mode_is_not(default_model, llamacpp, kv):
    from llorch_ref.references.llamacpp import LlamaCpp

    ref = LlamaCpp(default_model, n_ctx=256, kv_dtype=kv)
    exact = llorch_ref.load(default_model, numerics="exact", kv_dtype=kv)
    ggml = llorch_ref.load(default_model, numerics="ggml", kv_dtype=kv)
    ids = exact.tokenizer.encode(PROMPT)
    lg = ref.eval(ids)
    m_exact, m_ggml = compare(exact.logits(ids), lg), compare(ggml.logits(ids), lg)
    print(f"Q4_1, {kv} K/V: exact NMSE {m_exact['nmse']:.3e} max abs {m_exact['max_abs']:.3e}; "
          f"ggml NMSE {m_ggml['nmse']:.3e} max abs {m_ggml['max_abs']:.3e}")
    assert m_ggml["max_abs"] == 0.0 and m_ggml["nmse"] == 0.0
    assert m_exact["nmse"] > 1e-4                  # the gap the ggml mode closes is real


@pytest.mark.parametrize("backend", ["numba", pytest.param("numpy", marks=pytest.mark.slow)])
def test_default_model_greedy_256_identical(default_model, llamacpp, backend):
    """256 greedy tokens with ggml's arithmetic on a float16 K/V cache equal llama.cpp's: on numba's fused step
    (about 10 s) in the default run; on the NumPy oracle's op-by-op emulation (about 140 s on 2 cores) with
    `-m slow` (its 16 first tokens and every checkpoint: test_diff_in_ggml_mode_passes_with_zero_band)."""
    from llorch_ref.references.llamacpp import LlamaCpp

    need_backend(backend)
    eng = llorch_ref.load(default_model, numerics="ggml", kv_dtype="float16", backend=backend)
    ids = eng.tokenizer.encode(PROMPT)
    ours = list(eng.generate_ids(ids, max_tokens=256, ignore_eos=True))
    assert backend == "numpy" or eng.backend.info["fused_decode"] is True
    assert ours == LlamaCpp(default_model, n_ctx=512, kv_dtype="float16").greedy(ids, 256)


def test_diff_in_ggml_mode_passes_with_zero_band(default_model, llamacpp):
    from llorch_ref.harness.run import run_diff

    eng = llorch_ref.load(default_model, numerics="ggml", kv_dtype="float32")
    res = run_diff(eng, n_greedy=16)
    assert res.band_class == "ggml" and res.first_divergence is None
    assert all(r.metrics.get("max_abs", 0.0) == 0.0 for r in res.rows)


def _llamacpp_quantize(llamacpp, src, dst, ftype, pure=False):
    import ctypes

    p = llamacpp.llama_model_quantize_default_params()
    p.ftype = ftype
    p.pure = pure
    assert llamacpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(p)) == 0
    return dst


def kquant_copy(tmp_path_factory, llamacpp, src, ftype):
    """llama.cpp's own copy of src at ftype ('Q4_K_M', ...; '-pure' keeps every matrix of that type), made once a
    session."""
    d = tmp_path_factory.getbasetemp() / "kquants"
    d.mkdir(exist_ok=True)
    path = d / f"{ftype}.gguf"
    if not path.exists():
        _llamacpp_quantize(llamacpp, src, path, getattr(llamacpp, f"LLAMA_FTYPE_MOSTLY_{ftype.split('-')[0]}"),
                           pure=ftype.endswith("pure"))
    return path


@pytest.mark.parametrize("kv", ["float32", "float16"])
@pytest.mark.parametrize("ftype, ktypes", [("Q4_K_M", {"Q4_K", "Q6_K"}), ("Q5_K_M", {"Q5_K", "Q6_K"}),
                                           ("Q2_K", {"Q3_K"}), ("Q2_K-pure", {"Q2_K"})])
def test_k_quant_copies_bit_identical(tmp_path_factory, default_f32, llamacpp, kv, ftype, ktypes):
    """Copies made by llama.cpp's own quantizer (K-quants where rows are multiples of 256, i.e. ffn_down
    here, Q4_0/Q5_0/Q5_1/Q8_0 fallbacks elsewhere; "pure" keeps Q2_K): logits bit-identical, greedy equal over 4
    decode steps (a float16 cache's rounding enters at the first; about 0.4 s a step on the NumPy emulation here;
    16 and 8 steps on numba's kernels: test_k_quant_copies_bit_identical_on_numba, on the same copies)."""
    from llorch_ref.references.llamacpp import LlamaCpp

    path = kquant_copy(tmp_path_factory, llamacpp, default_f32, ftype)
    eng = llorch_ref.load(path, numerics="ggml", kv_dtype=kv)
    assert ktypes <= set(eng.tensor_types.values())
    ref = LlamaCpp(path, n_ctx=256, kv_dtype=kv)
    ids = eng.tokenizer.encode(PROMPT)
    m = compare(eng.logits(ids), ref.eval(ids))
    assert m["max_abs"] == 0.0, m
    assert list(eng.generate_ids(ids, max_tokens=4, ignore_eos=True)) == ref.greedy(ids, 4)


@pytest.mark.parametrize("kv", ["float32", "float16"])
@pytest.mark.parametrize("ftype, kinds", [("Q4_K_M", {"Q4_K", "Q6_K"}), ("Q5_K_M", {"Q5_K", "Q6_K"}),
                                          ("Q2_K", {"Q3_K"}), ("Q2_K-pure", {"Q2_K"})])
def test_k_quant_copies_bit_identical_on_numba(tmp_path_factory, default_f32, llamacpp, kv, ftype, kinds):
    """numba's K-quant kernel (numba_ggml.kquant_rows: Q2_K..Q6_K on the file's blocks) on llama.cpp's own Q4_K_M,
    Q5_K_M and Q2_K copies of the default model (K-quants where rows are multiples of 256: ffn_down here): logits
    bit-identical to llama.cpp's, greedy equal (their Q, K and V of different types, Q5_0 and Q8_0, in some layers:
    the fused step's runs of one type)."""
    need_backend("numba")
    from llorch_ref.backends.numba_backend import GgmlKQuantMatrix
    from llorch_ref.references.llamacpp import LlamaCpp

    path = kquant_copy(tmp_path_factory, llamacpp, default_f32, ftype)
    eng = llorch_ref.load(path, backend="numba", numerics="ggml", kv_dtype=kv)
    got = {m.qtype for lw in eng.weights.layers for m in vars(lw).values() if isinstance(m, GgmlKQuantMatrix)}
    assert got == kinds, got
    ref = LlamaCpp(path, n_ctx=256, kv_dtype=kv)
    ids = eng.tokenizer.encode(PROMPT)
    m = compare(eng.logits(ids), ref.eval(ids))
    assert m["max_abs"] == 0.0, m
    n = 16 if kv == "float32" else 8
    assert list(eng.generate_ids(ids, max_tokens=n, ignore_eos=True)) == ref.greedy(ids, n)
    assert eng.backend.info["fused_decode"] is True


@pytest.mark.parametrize("ftype, kind", [("Q2_K", "Q3_K"), ("Q2_K-pure", "Q2_K")])
def test_q2_k_and_q3_k_copies_on_numba_kernels(tmp_path_factory, default_f32, llamacpp, ftype, kind):
    """llama.cpp's own Q2_K copies of the default model (Q3_K in ffn_down; "pure": Q2_K there) in exact numerics on
    numba: every matrix on a kernel that reads the blocks in place (no float32 copy, no BLAS), the fused decode step,
    logits the NumPy oracle's up to summation order, greedy tokens equal."""
    need_backend("numba")
    from llorch_ref.backends import numba_backend

    path = kquant_copy(tmp_path_factory, llamacpp, default_f32, ftype)
    eng, ref = llorch_ref.load(path, backend="numba"), llorch_ref.load(path)
    assert kind in set(eng.tensor_types.values())
    numba_backend.PATHS.clear()
    ids = eng.tokenizer.encode(PROMPT)
    m = compare(eng.logits(ids), ref.logits(ids))
    assert m["nmse"] < 1e-9 and m["max_abs"] < 1e-3, m
    assert list(eng.generate_ids(ids, max_tokens=16, ignore_eos=True)) == list(
        ref.generate_ids(ids, max_tokens=16, ignore_eos=True))
    assert eng.backend.info["fused_decode"] is True
    assert any(k[0] == kind for k in numba_backend.PATHS) and all("numba kernel" in k[1] for k in numba_backend.PATHS)


@pytest.mark.parametrize("tied", [False, True])
def test_ggml_mode_reads_embedding_rows_on_lookup(tiny, tied):
    """numerics='ggml' keeps the token embedding as the file's blocks (llama.cpp's get_rows: a 7B file's 500 MB
    float32 copy was most of its load and of its peak above the file): a lookup gives the rows exact mode
    dequantizes at load, bit for bit."""
    path = tiny(vocab="none", weight_type="Q8_0", tied=tied)
    g, e = llorch_ref.load(path, numerics="ggml"), llorch_ref.load(path)
    assert not isinstance(g.weights.tok_embd, np.ndarray)
    ids = np.array([[3, 0, 77], [127, 3, 5]])
    assert np.array_equal(g.weights.tok_embd[ids], e.weights.tok_embd[ids])


def test_unimplemented_type_is_a_clear_error(tiny):
    from llorch_ref.errors import UnsupportedModelError

    path = tiny(vocab="none", weight_type="BF16")
    with pytest.raises(UnsupportedModelError, match="numerics='ggml' does not implement BF16"):
        llorch_ref.load(path, numerics="ggml")
    llorch_ref.load(path, numerics="exact")          # the exact mode dequantizes every type gguf knows


# -- the fused numba step (backends/numba_ggml.py): each piece against the NumPy emulation, the step against
# llama.cpp --------------------------------------------------------------------------------------------------
def _g():
    need_backend("numba")
    from llorch_ref.backends import numba_ggml
    return numba_ggml


@pytest.mark.parametrize("lanes", [8, 16])
def test_numba_v_expf_equals_the_emulation_bit_for_bit(lanes):
    g = _g()
    rng = np.random.default_rng(5)
    x = np.concatenate([np.linspace(-200, 100, 200001, dtype=np.float32),          # both overflow branches
                        (rng.standard_normal(20000) * 30).astype(np.float32),
                        np.array([0.0, -0.0, -np.inf, 1e-40, -1e-40, 88.7, -87.3, -103.9], np.float32)])
    with np.errstate(all="ignore"):
        want = ggml_cpu.v_expf(x, lanes)
    got = np.array([g.v_expf(v, lanes) for v in x], np.float32)
    assert np.array_equal(got.view(np.int32), want.view(np.int32))
    assert not np.array_equal(want, ggml_cpu.v_expf(x, 24 - lanes))      # the two builds' exps do differ


@pytest.mark.parametrize("with_sum", [False, True])
def test_numba_activation_quantization_equals_the_emulation(with_sum):
    g = _g()
    rng = np.random.default_rng(6)
    x = (rng.standard_normal(8 * 32) * np.repeat([1e-4, 1, 50, 3e3, 0, 1, 7, 0.5], 32)).astype(np.float32)
    x[70] = 2.5 / 127 * 50                                             # halfway cases for rint
    q, d, s = np.empty(x.shape, np.int8), np.empty(8, np.float32), np.empty(8, np.float32)
    g.quantize_q8(x, q, d, s)
    wq, wd, ws = ggml_cpu.quantize_q8(x[None], with_sum=with_sum)
    assert np.array_equal(q, wq.reshape(-1).astype(np.int8)) and np.array_equal(d, wd[0])
    if with_sum:
        assert np.array_equal(s, ws[0])


@pytest.mark.parametrize("lanes", [8, 16])
@pytest.mark.parametrize("n_pos", [1, 7, 33, 70])
@pytest.mark.parametrize("kv_dtype", ["float32", "float16"])
def test_numba_one_token_attention_equals_the_emulation(n_pos, kv_dtype, lanes):
    """Over the first n_pos rows of a longer cache; a float16 cache passed as its bits (uint16), as the step does."""
    g = _g()
    rng = np.random.default_rng(n_pos)
    h, kv, hd = 6, 2, 64
    q = rng.standard_normal((h, hd)).astype(np.float32)
    k = (rng.standard_normal((n_pos + 5, kv, hd)) * 3).astype(kv_dtype)
    v = rng.standard_normal((n_pos + 5, kv, hd)).astype(kv_dtype)
    kv_head = np.arange(h) // (h // kv)
    want, _, _ = ggml_cpu.make_attention(kv_dtype, lanes)(np, q[None], k[:n_pos].astype(np.float32),
                                                          v[:n_pos].astype(np.float32),
                                                          np.zeros((1, n_pos), np.float32), 0.125, kv_head)
    bits = (lambda a: a.view(np.uint16)) if kv_dtype == "float16" else (lambda a: a)
    got = g.attend(q, bits(k), bits(v), n_pos, 0.125, kv_head, lanes)
    assert np.array_equal(got, want[0])
    bad = g.attend(q, bits(k), bits(v[:, ::-1].copy()), n_pos, 0.125, kv_head, lanes)   # planted: KV heads swapped
    assert not np.array_equal(bad, want[0])


@pytest.mark.parametrize("lanes", [8, 16])
@pytest.mark.parametrize("t,s,hd", [(5, 5, 64), (9, 37, 48), (33, 70, 128)])
@pytest.mark.parametrize("kv_dtype", ["float32", "float16"])
def test_numba_several_token_attention_equals_the_emulation(t, s, hd, kv_dtype, lanes):
    """numba_ggml.attend_rows (a prefill's attention, tinyBLAS's lanes) against ggml_cpu's emulation, its output, kq
    and probabilities bit for bit: T new tokens after S - T cached ones, causal mask, 6 query heads on 2 KV heads,
    Hd with and without a remainder past 32 lanes, S not a multiple of 8; with masked positions skipped (causal and
    windowed masks), the same output. Planted: P not rounded to float16 on a float16 cache (the output differs), the
    KV heads swapped (all differ)."""
    g = _g()
    rng = np.random.default_rng(t * s)
    h, kv = 6, 2
    q = rng.standard_normal((t, h, hd)).astype(np.float32)
    k = (rng.standard_normal((s, kv, hd)) * 3).astype(kv_dtype)
    v = rng.standard_normal((s, kv, hd)).astype(kv_dtype)
    kv_head = np.arange(h) // (h // kv)
    pos = np.arange(s - t, s)[:, None]
    mask = np.where(np.arange(s)[None, :] <= pos, 0.0, -np.inf).astype(np.float32)
    attention = ggml_cpu.make_attention(kv_dtype, lanes)
    want = attention(np, q, k.astype(np.float32), v.astype(np.float32), mask, 0.125, kv_head)
    half, k32, v32 = kv_dtype == "float16", k.astype(np.float32), v.astype(np.float32)
    got = g.attend_rows(q, k32, v32, mask, np.float32(0.125), kv_head, half, lanes, False)
    for a, b in zip(got, want):
        assert a.shape == b.shape and np.array_equal(a, b)
    assert g.can_skip_masked(q, k32, v32, half)          # nobody sees kq or probs: masked positions left out, same out
    window = mask.copy()
    window[np.arange(s)[None, :] < pos - 3] = -np.inf     # a sliding window's masked start as well
    for m in (mask, window):
        full = attention(np, q, k32, v32, m, 0.125, kv_head)[0]
        assert np.array_equal(g.attend_rows(q, k32, v32, m, np.float32(0.125), kv_head, half, lanes, True)[0], full)
    v_inf = v32.copy()
    v_inf[-1, 0, 0] = np.inf                              # ggml's 0 * inf = NaN must come out: no skipping
    assert not g.can_skip_masked(q, k32, v_inf, half) and not g.can_skip_masked(q * np.float32(1e19), k32, v32, half)
    bad = g.attend_rows(q, k32[:, ::-1].copy(), v32, mask, np.float32(0.125), kv_head, half, lanes, False)
    assert not any(np.array_equal(a, b) for a, b in zip(bad, want))
    other = ggml_cpu.make_attention(kv_dtype, 24 - lanes)(np, q, k32, v32, mask, 0.125, kv_head)
    assert not all(np.array_equal(a, b) for a, b in zip(other, got))     # the other build's lanes: other bits
    if kv_dtype == "float16":
        loose = ggml_cpu.make_attention("float32", lanes)(np, q, k.astype(np.float32), v.astype(np.float32), mask,
                                                           0.125, kv_head)
        assert not np.array_equal(loose[0], got[0])                  # the float16 roundings are seen


@pytest.mark.parametrize("wt", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "k_mixed"])
@pytest.mark.parametrize("kv", ["float32", "float16"])
def test_fused_numba_ggml_decode_bit_identical_to_llamacpp(tiny, llamacpp, wt, kv):
    """The decoder generation uses (one numba call a step) against llama.cpp's decode, every logit, 6 steps, on
    either K/V cache type (k_mixed: Q4_K and Q6_K mixed in Q/K/V and between layers, as in a Q4_K_M file)."""
    from llorch_ref.backends.numba_backend import GgmlFusedDecoder
    from llorch_ref.references.llamacpp import LlamaCpp

    need_backend("numba")
    wide = dict(d_model=256, d_ff=512, n_layers=3) if wt == "k_mixed" else {}
    path = tiny(vocab="none", weight_type=wt, **wide)
    eng = llorch_ref.load(path, numerics="ggml", kv_dtype=kv, backend="numba")
    ref = LlamaCpp(path, n_ctx=128, kv_dtype=kv)
    cache = eng.new_cache()
    eng.forward(IDS, cache, rows=[len(IDS) - 1])
    dec = eng.backend.make_decoder(eng, cache)
    assert isinstance(dec, GgmlFusedDecoder)
    ref._decode(IDS, 0, None, all_logits=False)
    for i, tok in enumerate([5, 9, 33, 2, 77, 5]):
        assert np.array_equal(dec(tok), ref._decode([tok], len(IDS) + i, None, all_logits=False)), f"step {i}"
    ref.close()


def test_default_model_fused_numba_ggml_greedy_identical(default_model, llamacpp):
    """generate() on numba with numerics='ggml' (the fused step) against llama.cpp's greedy tokens, 64 tokens on a
    float32 cache (on a float16 one: 256 tokens, test_default_model_greedy_256_identical[numba])."""
    from llorch_ref.references.llamacpp import LlamaCpp

    need_backend("numba")
    kv = "float32"
    eng = llorch_ref.load(default_model, numerics="ggml", kv_dtype=kv, backend="numba")
    ids = eng.tokenizer.encode(PROMPT)
    ours = list(eng.generate_ids(ids, max_tokens=64, ignore_eos=True))
    assert eng.backend.info["fused_decode"] is True
    assert ours == LlamaCpp(default_model, n_ctx=256, kv_dtype=kv).greedy(ids, 64)


@pytest.mark.parametrize("lanes", [8, 16])
@pytest.mark.parametrize("neox", [False, True])
def test_numba_rope_norm_and_swiglu_equal_the_emulation(neox, lanes):
    g = _g()
    rng = np.random.default_rng(7)
    x = rng.standard_normal((4, 64)).astype(np.float32)
    cos, sin = ggml_cpu.rope_angles(np, 40, 48, 10000.0)                     # 48 of 64 dims rotated
    want = ggml_cpu.rope(np, x[None], cos[39:40], sin[39:40], "neox" if neox else "adjacent")[0]
    assert np.array_equal(g.rope(x, cos[39], sin[39], neox), want)
    h, w = (rng.standard_normal(576) * 4).astype(np.float32), rng.standard_normal(576).astype(np.float32)
    assert np.array_equal(g.rms_norm(h, w, 1e-5), ggml_cpu.make_ops().rms_norm(np, h[None], w, 1e-5)[0])
    hs = (rng.standard_normal((7, 576)) * rng.uniform(1e-3, 30, (7, 1))).astype(np.float32)     # a prompt's rows
    assert np.array_equal(g.rms_norm_rows(hs, w, np.float32(1e-5)), ggml_cpu.make_ops().rms_norm(np, hs, w, 1e-5))
    assert not np.array_equal(g.rms_norm_rows(hs, w, np.float32(1e-6)), ggml_cpu.make_ops().rms_norm(np, hs, w, 1e-5))
    gu = (rng.standard_normal(2 * 96) * 6).astype(np.float32)
    want = (ggml_cpu.silu(np, gu[None, :96], lanes) * gu[None, 96:]).astype(np.float32)[0]
    assert np.array_equal(g.swiglu_hidden(gu, 96, lanes), want)
    rows = (rng.standard_normal((5, 2, 96)) * 6).astype(np.float32)                 # a prompt's gate and up rows
    want = (ggml_cpu.silu(np, rows[:, 0], lanes) * rows[:, 1]).astype(np.float32)
    assert np.array_equal(g.silu_mul_rows(rows[:, 0].copy(), rows[:, 1].copy(), lanes), want)
    assert not np.array_equal(g.silu_mul_rows(rows[:, 0].copy(), rows[:, 1].copy(), 24 - lanes), want)


@pytest.mark.parametrize("kv", ["float32", "float16"])
def test_default_model_fused_numba_ggml_step_equals_the_op_by_op_step(default_model, monkeypatch, kv):
    """Logits and every layer's K/V cache after 8 steps, fused against op by op (LLORCH_NUMBA_FUSED=0), to the bit:
    the cache holds RoPE's output before any quantization, so a one-ulp slip there shows."""
    need_backend("numba")
    eng = llorch_ref.load(default_model, numerics="ggml", kv_dtype=kv, backend="numba")
    ids = eng.tokenizer.encode(PROMPT)
    runs = []
    for fused in ("1", "0"):
        monkeypatch.setenv("LLORCH_NUMBA_FUSED", fused)
        cache = eng.new_cache()
        tok = int(eng.forward(ids, cache, rows=[len(ids) - 1])[0].argmax())
        dec, logits = eng.backend.make_decoder(eng, cache), []
        for _ in range(8):
            logits.append(dec(tok))
            tok = int(logits[-1][0].argmax())
        runs.append((np.concatenate(logits), cache.k[:, :cache.pos].copy(), cache.v[:, :cache.pos].copy()))
    for a, b in zip(*runs):
        assert np.array_equal(a, b)


def test_a_llamacpp_dump_declares_its_builds_vector_width_and_diff_reproduces_that_build(llamacpp, tiny, tmp_path,
                                                                                        monkeypatch):
    """A llama.cpp dump declares the width of the build it came from (AVX2 or AVX-512: their float sums differ);
    `diff --subject` runs numerics ggml for that build: every tensor equal to the bit, locally and end to end; told
    to reproduce the other width (--ggml-simd), the local comparisons differ in the last bits (inside the bands).
    --ggml-simd with exact numerics is refused."""
    import json
    import subprocess
    import sys

    from llorch_ref.numerics.ggml_build import installed_simd
    from llorch_ref.references import llamacpp as L
    from llorch_ref.references.engines import dump_llamacpp

    path = tiny(weight_type="Q8_0", vocab="none")
    rec = dump_llamacpp(path, token_ids=list(range(1, 40)), n_greedy=2)
    here = "avx512" if any(f.startswith("AVX512") for f in rec.extra["arithmetic"]["settings"]["build"]) else "avx2"
    assert rec.extra["arithmetic"]["ggml_simd"] == here == installed_simd()
    with monkeypatch.context() as m:
        m.setattr(L, "build_features", lambda: ["AVX2", "AVX512", "AVX512_VNNI"])
        assert dump_llamacpp(path, token_ids=[1, 2, 3], n_greedy=1).extra["arithmetic"]["ggml_simd"] == "avx512"
    out = rec.save(tmp_path / "lc.safetensors")

    def diff(*a):
        return subprocess.run([sys.executable, "-m", "llorch_ref.cli", "diff", "--subject", str(out), "--model",
                               str(path), "--json", *a], capture_output=True, text=True, timeout=600)
    same = diff()
    assert same.returncode == 0 and f"({here} build)" in same.stderr, same.stderr
    rows = json.loads(same.stdout)["rows"]
    assert len(rows) > 20 and all(r.get("max_abs", 0.0) == 0.0 and r["local"].get("max_abs", 0.0) == 0.0
                                  and r.get("agreement", 1.0) == 1.0 for r in rows if "local" in r)
    other = diff("--ggml-simd", "avx2" if here == "avx512" else "avx512")      # inside the bands, not the same bits
    assert other.returncode == 0 and "build)" in other.stderr, other.stderr
    assert any(r["local"].get("max_abs", 0.0) > 0.0 for r in json.loads(other.stdout)["rows"] if "local" in r)
    bad = diff("--numerics", "exact", "--ggml-simd", "avx512")
    assert bad.returncode != 0 and "applies to --numerics ggml" in bad.stderr and "Traceback" not in bad.stderr


def test_ggml_simd_is_applied_or_refused(tiny, monkeypatch):
    """--ggml-simd picks the build numerics ggml reproduces (the ops' lanes, the float matrices' lanes); auto follows
    the installed llama-cpp-python (None installed: avx2); a bad value, or any value with exact numerics, is a
    ParameterError; the CLI refuses it for an engine that is not llorch-ref's."""
    import subprocess
    import sys

    from llorch_ref.errors import ParameterError
    from llorch_ref.numerics import ggml_build

    path = tiny(vocab="none", weight_type="F32")
    for simd, lanes in (("avx2", 8), ("avx512", 16)):
        eng = llorch_ref.load(path, numerics="ggml", ggml_simd=simd)
        assert eng.ggml_simd == simd and eng.ops.lanes == lanes and eng.weights.layers[0].wq.lanes == lanes
    monkeypatch.setattr(ggml_build, "installed_build_features", lambda: None)
    assert llorch_ref.load(path, numerics="ggml").ggml_simd == "avx2"
    monkeypatch.setattr(ggml_build, "installed_build_features", lambda: ["AVX2", "AVX512"])
    assert llorch_ref.load(path, numerics="ggml").ggml_simd == "avx512"
    assert llorch_ref.load(path).ggml_simd is None
    for kw, msg in [(dict(numerics="ggml", ggml_simd="avx9"), "must be 'auto'"),
                    (dict(ggml_simd="avx512"), "applies to --numerics ggml")]:
        with pytest.raises(ParameterError, match=msg):
            llorch_ref.load(path, **kw)
    r = subprocess.run([sys.executable, "-m", "llorch_ref.cli", "dump", "--engine", "llamacpp", "--model", str(path),
                        "--ggml-simd", "avx2", "--out", str(path.with_suffix(".never.safetensors"))],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "--ggml-simd avx2" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not path.with_suffix(".never.safetensors").exists()


def test_a_llamacpp_that_fails_to_load_counts_as_none_installed(monkeypatch, tmp_path):
    """A libllama that does not load (read directly on Linux), or llama_cpp raising RuntimeError when its shared
    library does not load (elsewhere): numerics ggml's auto then reproduces the AVX2 build (the default) instead of
    failing the load with a traceback."""
    import builtins
    import sys

    from llorch_ref.numerics import ggml_build

    if ggml_build._library_path() is not None:
        (tmp_path / "libllama.so").write_bytes(b"not a shared library")
        monkeypatch.setenv("LLAMA_CPP_LIB_PATH", str(tmp_path))
        assert ggml_build._library_path() == tmp_path / "libllama.so"
        assert ggml_build.installed_build_features() is None and ggml_build.installed_simd() is None
        assert llorch_ref.resolve_ggml_simd("ggml") == "avx2"
    real = builtins.__import__

    def broken(name, *a, **k):
        if name == "llama_cpp":
            raise RuntimeError("Failed to load shared library 'libllama.so'")
        return real(name, *a, **k)
    monkeypatch.delitem(sys.modules, "llama_cpp", raising=False)
    monkeypatch.setattr(builtins, "__import__", broken)
    monkeypatch.setattr(ggml_build, "_library_path", lambda: None)
    assert ggml_build.installed_build_features() is None and ggml_build.installed_simd() is None
    assert llorch_ref.resolve_ggml_simd("ggml") == "avx2"


def test_the_builds_features_are_read_from_its_library_without_importing_llama_cpp(llamacpp, tiny):
    """numerics ggml's auto reads the installed build's features from the libllama llama_cpp loads, without
    importing llama_cpp (its chat formats and jinja2: 30-60 ms of the load): the same features llama_cpp itself
    reports, and a fresh process loading a model with numerics ggml leaves llama_cpp unimported. Planted: the
    features through llama_cpp's import -> the second part fails."""
    import subprocess
    import sys

    from llorch_ref.numerics import ggml_build

    if ggml_build._library_path() is None:
        pytest.skip("llama_cpp's libllama is not where it keeps it on Linux: read through llama_cpp's import")
    assert ggml_build.installed_build_features() == ggml_build._features_through_llama_cpp()
    code = ("import sys, llorch_ref; e = llorch_ref.load(sys.argv[1], numerics='ggml'); "
            "print(e.ggml_simd, 'llama_cpp' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code, str(tiny(vocab="none", weight_type="F32"))],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.split() == [ggml_build.installed_simd(), "False"], (r.stdout, r.stderr)


def test_numba_rope_tables_are_the_c_librarys_cosf_and_sinf_to_the_bit():
    """The numba backend builds ggml's RoPE tables with the C library's cosf/sinf called from machine code
    (numba_ggml.map_c_float) where the NumPy emulation calls them through ctypes one value at a time: the same
    tables, bit for bit, for plain, scaled and per-dimension-factored angles; and each value is cosf's own (ctypes
    on the first values). Planted: sinf for cosf -> fails."""
    need_backend("numba")
    from llorch_ref.backends import numba_ggml as G

    factors = tuple(np.linspace(1, 8, 24).astype(np.float32).tolist())
    for args in ((512, 64, 10000.0, 1.0, None), (300, 48, 500000.0, 0.25, factors)):
        want = ggml_cpu._rope_tables_uncached(*args)
        got = ggml_cpu._rope_tables_uncached(*args, map_c=G.map_c_float)
        assert all(np.array_equal(w, g) for w, g in zip(want, got)), args
    cosf, sinf = ggml_cpu.libm_cosf_sinf()
    xs = np.linspace(-40, 900, 257).astype(np.float32)
    assert G.map_c_float(cosf, xs).tolist() == [np.float32(cosf(float(v))) for v in xs]
    assert not np.array_equal(G.map_c_float(sinf, xs), G.map_c_float(cosf, xs))
