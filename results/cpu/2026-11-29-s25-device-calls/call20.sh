# call 20 (session 25): per-type streaming speed of the one-token kernels (bw.py), then the 7B Q4_K_M bench again,
# 5 rounds, 32 decode tokens
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site512 .whl512/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD/.dev/noscipy:/tmp/site512:/tmp/site:$PWD PYTHONUNBUFFERED=1
uptime
python3 results/cpu/2026-11-29-s25-device-calls/bw.py
[ -f /tmp/l7-q4km.gguf ] || python3 tools/make_big_model.py --shape llama2-7b --type Q4_K_M --out /tmp/l7-q4km.gguf 2>&1 | tail -1
timeout 420 python3 -m llorch_ref.cli bench --model /tmp/l7-q4km.gguf --engines numba,numba-ggml,llamacpp --threads 2 --prefill 8 --decode 32 --repeats 5 --interleave --json $OUT/dev20-7b-q4km-t2-avx512.json 2>&1 | grep -vE '^llorch-ref bench: |by path|registers|^$' | head -9
