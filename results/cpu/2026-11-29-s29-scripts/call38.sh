# call 38 (session 29): the final code on the Xeon: a Llama-2-7B-shaped Q4_K_M file (Q4_K and Q6_K: the one-token Q6_K
# loop of 5d43313) at prefill 8, decode 16, 3 rounds, and the default model's shape, 5 rounds; numba / llama.cpp
# (AVX-512)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site512 .whl512/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD/.dev/noscipy:/tmp/site512:/tmp/site:$PWD PYTHONUNBUFFERED=1
lscpu | grep -E 'Model name'; uptime
python3 -m compileall -q /tmp/site /tmp/site512 llorch_ref > /dev/null
T0=$(date +%s)
python3 tools/make_big_model.py --shape llama2-7b --type Q4_K_M --out /tmp/l7.gguf 2>&1 | tail -1
python3 tools/make_big_model.py --shape smollm2-135m --type Q4_1 --vocab-from .dev/smol-vocab.gguf --out /tmp/smol.gguf > /dev/null 2>&1
python3 -c '
import llorch_ref
for f in ("/tmp/l7.gguf", "/tmp/smol.gguf"):
    e = llorch_ref.load(f, backend="numba")
    e.forward(list(range(1, 9)), e.new_cache(), rows=[7]); list(e.generate_ids(list(range(1, 9)), max_tokens=2, ignore_eos=True))
print("warm")'
echo "warm after $(( $(date +%s) - T0 )) s"
timeout 200 python3 -m llorch_ref.cli bench --model /tmp/l7.gguf --engines numba,llamacpp --threads 2 --prefill 8 --decode 16 --repeats 3 --interleave --json $OUT/dev38-7b-q4km.json 2>&1 | grep -vE '^llorch-ref bench: |by path|registers|^$' | head -8
rm -f /tmp/l7.gguf
echo "7b done after $(( $(date +%s) - T0 )) s"
timeout 150 python3 -m llorch_ref.cli bench --model /tmp/smol.gguf --engines numba,llamacpp --threads 2 --repeats 5 --interleave --json $OUT/dev38-smol.json 2>&1 | grep -vE '^llorch-ref bench: |by path|registers|^$' | head -8
echo "all done after $(( $(date +%s) - T0 )) s"
