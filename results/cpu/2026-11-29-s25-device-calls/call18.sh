# call 18 (session 25): the default model's shape on the Xeon: load phases in fresh processes, greedy 64 vs the AVX-512
# build, bench numba / numba-ggml / llama.cpp (5 rounds); then its Q4_K_M-like mix can't be made (576 not /256): skip
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site512 .whl512/*.whl || exit 1
export PYTHONPATH=$PWD/.dev/noscipy:/tmp/site512:/tmp/site:$PWD PYTHONUNBUFFERED=1
lscpu | grep -E 'Model name|^CPU\(s\)|L2|L3'; uptime
python3 -c "import numba, llama_cpp; print('numba', numba.__version__, 'llama_cpp', llama_cpp.__version__)"
python3 -m compileall -q /tmp/site /tmp/site512 llorch_ref > /dev/null
python3 tools/make_big_model.py --shape smollm2-135m --type Q4_1 --vocab-from .dev/smol-vocab.gguf --out /tmp/smol.gguf > /dev/null 2>&1
python3 -c "
import llorch_ref
for n in ('exact', 'ggml'):
    e = llorch_ref.load('/tmp/smol.gguf', backend='numba', numerics=n)
    ids = e.tokenizer.encode('The history of the world is long and full of surprises. ' * 12)[:128]
    e.forward(ids, e.new_cache(), rows=[127]); list(e.generate_ids(ids[:8], max_tokens=4, ignore_eos=True))
print('warm')"
echo "== load phases, fresh processes"; for i in 1 2 3 4 5 6; do python3 .dev/phases.py /tmp/smol.gguf; done
echo "== greedy 64, numba ggml vs the AVX-512 build"
python3 - <<'PY'
import llorch_ref
from llorch_ref.references.llamacpp import LlamaCpp
e = llorch_ref.load('/tmp/smol.gguf', backend='numba', numerics='ggml')
ids = e.tokenizer.encode("Once upon a time, there was a little")
ours = list(e.generate_ids(ids, max_tokens=64, ignore_eos=True))
theirs = LlamaCpp('/tmp/smol.gguf', n_ctx=256).greedy(ids, 64)
print(e.ggml_simd, "equal", ours == theirs, sum(a == b for a, b in zip(ours, theirs)), "/ 64", "fused", e.backend.info["fused_decode"])
PY
echo "== bench vs the AVX-512 build"
python3 -m llorch_ref.cli bench --model /tmp/smol.gguf --engines numba,numba-ggml,llamacpp --threads 2 --repeats 5 --interleave --json $OUT/dev18-smol-t2-avx512.json 2>&1 | grep -vE '^llorch-ref bench: |by path|registers|^$'
