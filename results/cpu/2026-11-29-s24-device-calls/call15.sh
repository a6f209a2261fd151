. .dev/setup.sh > /tmp/setup.log 2>&1; grep -E "Model name|numba " /tmp/setup.log
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site512 .whl512/*.whl || exit 1
python3 -m compileall -q /tmp/site /tmp/site512 llorch_ref > /dev/null
export PYTHONPATH=$PWD/.dev/noscipy:/tmp/site512:$PYTHONPATH
python3 -c "import llvmlite.binding as ll; ll.initialize_native_target(); f = ll.get_host_cpu_features(); print('vnni', f.get('avxvnni'), f.get('avx512vnni'))"
echo "== ggml numerics tests against the AVX-512 build (its 16 lanes), the new kernels"
python3 -m pytest -q -p no:cacheprovider tests/test_ggml_numerics.py -k "not default_model and not k_quant_copies" 2>&1 | grep -E "FAILED|passed|failed" | head; echo "pytest rc=${PIPESTATUS[0]}"
python3 tools/make_big_model.py --shape smollm2-135m --type Q4_1 --vocab-from .dev/smol-vocab.gguf --out /tmp/smol.gguf > /dev/null 2>&1
python3 -c "
import llorch_ref
for n in ('exact', 'ggml'):
    e = llorch_ref.load('/tmp/smol.gguf', backend='numba', numerics=n)
    ids = e.tokenizer.encode('The history of the world is long and full of surprises. ' * 12)[:128]
    e.forward(ids, e.new_cache(), rows=[127]); list(e.generate_ids(ids[:8], max_tokens=4, ignore_eos=True))
print('warm')"
echo "== greedy 64, numba ggml vs the AVX-512 build"
python3 - <<'PY'
import numpy as np, llorch_ref
from llorch_ref.references.llamacpp import LlamaCpp
for kv in ("float32", "float16"):
    e = llorch_ref.load('/tmp/smol.gguf', backend='numba', numerics='ggml', kv_dtype=kv)
    ids = e.tokenizer.encode("Once upon a time, there was a little")
    ref = LlamaCpp('/tmp/smol.gguf', n_ctx=256, kv_dtype=kv)
    print(kv, e.ggml_simd, "prompt logits max abs", float(np.abs(e.logits(ids) - ref.eval(ids)).max()))
    ours = list(e.generate_ids(ids, max_tokens=64, ignore_eos=True))
    theirs = LlamaCpp('/tmp/smol.gguf', n_ctx=256, kv_dtype=kv).greedy(ids, 64)
    print(kv, "equal", ours == theirs, sum(a == b for a, b in zip(ours, theirs)), "/ 64")
PY
echo "== bench vs the AVX-512 build"
python3 -m llorch_ref.cli bench --model /tmp/smol.gguf --engines numba,numba-ggml,llamacpp --threads 2 --repeats 5 --interleave --json $OUT/dev15-smol-t2-avx512.json 2>&1 | grep -vE '^llorch-ref bench: |by path|registers|^$'
