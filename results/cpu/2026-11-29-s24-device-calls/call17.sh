. .dev/setup.sh > /tmp/setup.log 2>&1
export PYTHONPATH=$PWD/.dev/noscipy:/tmp/site512:$PYTHONPATH
T0=$(date +%s)
python3 tools/make_big_model.py --shape llama2-7b --type Q4_K --out /tmp/l7-q4k.gguf 2>&1 | tail -1
echo "made in $(( $(date +%s) - T0 )) s"
python3 - <<'PY'
import numpy as np, time, llorch_ref
from llorch_ref.references.llamacpp import LlamaCpp
t = time.perf_counter()
e = llorch_ref.load('/tmp/l7-q4k.gguf', backend='numba', numerics='ggml', kv_dtype='float16')
ids = [1, 450, 3186, 310, 278, 3186, 338, 1472]
ours = e.logits(ids)[-1]
ref = LlamaCpp('/tmp/l7-q4k.gguf', n_ctx=64, kv_dtype='float16')
print("7B Q4_K numba-ggml", e.ggml_simd, "vs the AVX-512 build: last-token logits max abs", float(np.abs(ours - ref.eval(ids)[-1]).max()), f"({time.perf_counter() - t:.0f} s)")
PY
echo "== bench (after $(( $(date +%s) - T0 )) s)"
timeout 380 python3 -m llorch_ref.cli bench --model /tmp/l7-q4k.gguf --engines numba,numba-ggml,llamacpp --threads 2 --prefill 8 --decode 16 --repeats 3 --interleave --json $OUT/dev17-7b-q4k-t2-avx512.json 2>&1 | grep -vE '^llorch-ref bench: |by path|registers|^$' | head -12
