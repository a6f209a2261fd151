# call 28 (session 27): the final code on the Xeon, a Llama-2-7B-shaped file of type $1 (Q4_0 or Q4_K, made there by
# tools/make_big_model.py): bench numba / numba-ggml / llama.cpp (the AVX-512 build), prefill 8, decode 16, 5 rounds
T=${1:-Q4_0}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site512 .whl512/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD/.dev/noscipy:/tmp/site512:/tmp/site:$PWD PYTHONUNBUFFERED=1
lscpu | grep -E 'Model name'; uptime; free -g | head -2
python3 -m compileall -q /tmp/site /tmp/site512 llorch_ref > /dev/null
T0=$(date +%s)
[ -f /tmp/l7-$T.gguf ] || python3 tools/make_big_model.py --shape llama2-7b --type $T --out /tmp/l7-$T.gguf 2>&1 | tail -1
echo "made in $(( $(date +%s) - T0 )) s"
timeout 480 python3 -m llorch_ref.cli bench --model /tmp/l7-$T.gguf --engines numba,numba-ggml,llamacpp --threads 2 --prefill 8 --decode 16 --repeats 5 --interleave --json $OUT/dev28-7b-$T-t2-avx512.json 2>&1 | grep -vE '^llorch-ref bench: |by path|registers|^$' | head -12
echo "bench done after $(( $(date +%s) - T0 )) s"
