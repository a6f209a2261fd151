. .dev/setup.sh
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site512 .whl512/*.whl || exit 1
python3 -m compileall -q /tmp/site /tmp/site512 llorch_ref > /dev/null
bench() { python3 -m llorch_ref.cli bench "$@" 2>&1 | grep -vE '^llorch-ref bench: |by path|registers|^$' ; }
echo "== ggml numerics tests against the AVX-512 build"
PYTHONPATH=/tmp/site512:$PYTHONPATH python3 -m pytest -q -p no:cacheprovider tests/test_ggml_numerics.py -k "not default_model and not k_quant_copies" 2>&1 | tail -8
echo "== the same against the AVX2 wheel"
python3 -m pytest -q -p no:cacheprovider tests/test_ggml_numerics.py -k "not default_model and not k_quant_copies" 2>&1 | tail -4
python3 tools/make_big_model.py --shape smollm2-135m --type Q4_1 --vocab-from .dev/smol-vocab.gguf --out /tmp/smol.gguf 2>/dev/null
python3 -c "import llorch_ref; llorch_ref.load('/tmp/smol.gguf', backend='numba', numerics='ggml', ggml_simd='avx512')"
echo "== smol numba-ggml (AVX-512 sums) vs AVX-512 wheel"
PYTHONPATH=/tmp/site512:$PYTHONPATH bench --model /tmp/smol.gguf --engines numba,numba-ggml,llamacpp --threads 2 --repeats 5 --interleave --json $OUT/dev7-smol-t2-avx512.json
echo "== greedy 64 tokens, numba ggml avx512 vs the AVX-512 wheel"
PYTHONPATH=/tmp/site512:$PYTHONPATH python3 - <<'PY'
import llorch_ref
from llorch_ref.references.llamacpp import LlamaCpp
for kv in ("float32", "float16"):
    e = llorch_ref.load('/tmp/smol.gguf', backend='numba', numerics='ggml', kv_dtype=kv)
    ids = e.tokenizer.encode("Once upon a time, there was a little")
    ours = list(e.generate_ids(ids, max_tokens=64, ignore_eos=True))
    ref = LlamaCpp('/tmp/smol.gguf', n_ctx=256, kv_dtype=kv).greedy(ids, 64)
    print(kv, e.ggml_simd, "fused", e.backend.info.get("fused_decode"), "equal", ours == ref, sum(a == b for a, b in zip(ours, ref)), "/ 64")
PY
