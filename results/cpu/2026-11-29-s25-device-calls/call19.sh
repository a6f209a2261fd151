# call 19 (session 25): a Llama-2-7B-shaped Q4_K_M file (llama.cpp's mix of Q4_K and Q6_K) on the Xeon: numba-ggml's
# last-token logits vs the AVX-512 build, then bench numba / numba-ggml / llama.cpp (3 rounds)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site512 .whl512/*.whl || exit 1
export PYTHONPATH=$PWD/.dev/noscipy:/tmp/site512:/tmp/site:$PWD PYTHONUNBUFFERED=1
lscpu | grep -E 'Model name'; uptime
T0=$(date +%s)
python3 tools/make_big_model.py --shape llama2-7b --type Q4_K_M --out /tmp/l7-q4km.gguf 2>&1 | tail -1
echo "made in $(( $(date +%s) - T0 )) s"
python3 - <<'PY'
import numpy as np, time, llorch_ref
from llorch_ref.references.llamacpp import LlamaCpp
t = time.perf_counter()
e = llorch_ref.load('/tmp/l7-q4km.gguf', backend='numba', numerics='ggml', kv_dtype='float16')
ids = [1, 450, 3186, 310, 278, 3186, 338, 1472]
ours = e.logits(ids)[-1]
ref = LlamaCpp('/tmp/l7-q4km.gguf', n_ctx=64, kv_dtype='float16')
print("7B Q4_K_M numba-ggml", e.ggml_simd, "vs the AVX-512 build: last-token logits max abs", float(np.abs(ours - ref.eval(ids)[-1]).max()), f"({time.perf_counter() - t:.0f} s)")
ours = list(e.generate_ids(ids, max_tokens=8, ignore_eos=True))
print("greedy 8 equal", ours == ref.greedy(ids, 8), "fused", e.backend.info["fused_decode"])
PY
echo "== bench (after $(( $(date +%s) - T0 )) s)"
timeout 400 python3 -m llorch_ref.cli bench --model /tmp/l7-q4km.gguf --engines numba,numba-ggml,llamacpp --threads 2 --prefill 8 --decode 16 --repeats 3 --interleave --json $OUT/dev19-7b-q4km-t2-avx512.json 2>&1 | grep -vE '^llorch-ref bench: |by path|registers|^$' | head -14
