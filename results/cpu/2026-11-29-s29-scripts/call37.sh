# call 37 (session 29): one-token Q2_K (4 rows), Q3_K and Q6_K (2 rows), splats behind the barrier (5d43313) against
# session 28's final kernels (555d866's files in .dev/s29/base), in one process; then 7B-shaped Q2_K and Q3_K files,
# numba / llama.cpp (AVX-512), prefill 8, decode 16, 3 rounds
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site512 .whl512/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD/.dev/noscipy:/tmp/site512:/tmp/site:$PWD PYTHONUNBUFFERED=1
lscpu | grep -E 'Model name'; uptime
python3 -m compileall -q /tmp/site /tmp/site512 llorch_ref > /dev/null
T0=$(date +%s)
(cd .dev/s29 && timeout 200 python3 ab2.py s28 Q2_K,Q3_K,Q6_K 11008x4096,4096x11008 1 2,1 2>&1 | grep -v Warn)
echo "ab done after $(( $(date +%s) - T0 )) s"
for T in Q2_K Q3_K; do
python3 tools/make_big_model.py --shape llama2-7b --type $T --out /tmp/l7.gguf 2>&1 | tail -1
python3 -c '
import llorch_ref
e = llorch_ref.load("/tmp/l7.gguf", backend="numba")
e.forward(list(range(1, 9)), e.new_cache(), rows=[7]); list(e.generate_ids(list(range(1, 9)), max_tokens=2, ignore_eos=True))
print("warm")'
timeout 150 python3 -m llorch_ref.cli bench --model /tmp/l7.gguf --engines numba,llamacpp --threads 2 --prefill 8 --decode 16 --repeats 3 --interleave --json $OUT/dev37-7b-$T.json 2>&1 | grep -vE '^llorch-ref bench: |by path|registers|^$' | head -8
rm -f /tmp/l7.gguf
echo "$T done after $(( $(date +%s) - T0 )) s"
done
