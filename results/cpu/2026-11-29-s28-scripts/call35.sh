# call 35 (session 28): the final code (K-quant panels in passes) on the Xeon: K-quant kernel A/B against 5400f1e at
# 8 and 16 tokens; a Llama-2-7B-shaped Q4_K file at the must-show shape (prefill 8, decode 16), numba / numba-ggml /
# llama.cpp (AVX-512), 5 rounds; the default model's shape once
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site512 .whl512/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD/.dev/noscipy:/tmp/site512:/tmp/site:$PWD PYTHONUNBUFFERED=1
lscpu | grep -E 'Model name'; uptime
python3 -m compileall -q /tmp/site /tmp/site512 llorch_ref > /dev/null
T0=$(date +%s)
(cd .dev/s28 && timeout 90 python3 ab2.py 5400f1e Q4_K,Q6_K 4096x4096 8,16 2 2>&1 | grep -v Warn)
echo "ab done after $(( $(date +%s) - T0 )) s"
python3 tools/make_big_model.py --shape llama2-7b --type Q4_K --out /tmp/l7-Q4_K.gguf 2>&1 | tail -1
python3 -c '
import llorch_ref
for n in ("exact", "ggml"):
    e = llorch_ref.load("/tmp/l7-Q4_K.gguf", backend="numba", numerics=n)
    e.forward(list(range(1, 9)), e.new_cache(), rows=[7]); list(e.generate_ids(list(range(1, 9)), max_tokens=2, ignore_eos=True))
print("warm")'
echo "warm after $(( $(date +%s) - T0 )) s"; uptime
timeout 260 python3 -m llorch_ref.cli bench --model /tmp/l7-Q4_K.gguf --engines numba,numba-ggml,llamacpp --threads 2 --prefill 8 --decode 16 --repeats 5 --interleave --json $OUT/dev35-7b-q4k.json 2>&1 | grep -vE '^llorch-ref bench: |by path|registers|^$' | head -8
rm -f /tmp/l7-Q4_K.gguf
echo "7b done after $(( $(date +%s) - T0 )) s"
python3 tools/make_big_model.py --shape smollm2-135m --type Q4_1 --vocab-from .dev/smol-vocab.gguf --out /tmp/smol.gguf > /dev/null 2>&1
timeout 150 python3 -m llorch_ref.cli bench --model /tmp/smol.gguf --engines numba,llamacpp --threads 2 --repeats 5 --interleave --json $OUT/dev35-smol.json 2>&1 | grep -vE '^llorch-ref bench: |by path|registers|^$' | head -8
echo "all done after $(( $(date +%s) - T0 )) s"
