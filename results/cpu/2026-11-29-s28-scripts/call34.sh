# call 34 (session 28): the final panels on the Xeon at 7B widths: kernel A/B against 5400f1e (4096 x 4096 and
# 4096 x 11008, 16 and 48 tokens), then Llama-2-7B-shaped Q4_K and Q4_0 files: bench numba / llama.cpp (AVX-512),
# prefill 64, decode 4, 3 rounds
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site512 .whl512/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD/.dev/noscipy:/tmp/site512:/tmp/site:$PWD PYTHONUNBUFFERED=1
lscpu | grep -E 'Model name'; uptime
python3 -m compileall -q /tmp/site /tmp/site512 llorch_ref > /dev/null
T0=$(date +%s)
(cd .dev/s28 && timeout 150 python3 ab2.py 5400f1e Q4_0,Q4_K,Q6_K 4096x4096,4096x11008 16,48 2 2>&1 | grep -v Warn)
echo "ab done after $(( $(date +%s) - T0 )) s"
for T in Q4_K Q4_0; do
python3 tools/make_big_model.py --shape llama2-7b --type $T --out /tmp/l7-$T.gguf 2>&1 | tail -1
echo "made after $(( $(date +%s) - T0 )) s"; uptime
timeout 200 python3 -m llorch_ref.cli bench --model /tmp/l7-$T.gguf --engines numba,llamacpp --threads 2 --prefill 64 --decode 4 --repeats 3 --interleave --json $OUT/dev34-7b-$T-p64.json 2>&1 | grep -vE '^llorch-ref bench: |by path|registers|^$' | head -8
rm -f /tmp/l7-$T.gguf
echo "bench done after $(( $(date +%s) - T0 )) s"
done
