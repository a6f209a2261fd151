# call 44 (session 30, the final code 6764f3f): the must-show set on the Xeon with bytecode as an install leaves it (written once under
# PYTHONPYCACHEPREFIX; the image sets PYTHONDONTWRITEBYTECODE=1 over a numpy without bytecode): the default model's
# shape, then Llama-2-7B-shaped Q4_0 and Q4_K files at prefill 8, decode 16; numba / llama.cpp, 5 rounds each
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site512 .whl512/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD/.dev/noscipy:/tmp/site512:/tmp/site:$PWD PYTHONUNBUFFERED=1 PYTHONPYCACHEPREFIX=/tmp/pyc
unset PYTHONDONTWRITEBYTECODE
lscpu | grep -E 'Model name'; uptime
T0=$(date +%s)
python3 tools/make_big_model.py --shape smollm2-135m --type Q4_1 --vocab-from .dev/smol-vocab.gguf --out /tmp/smol.gguf > /dev/null 2>&1
python3 -c 'import llorch_ref, llama_cpp, llorch_ref.bench, llorch_ref.cli; e = llorch_ref.load("/tmp/smol.gguf", backend="numba"); e.forward([1,2,3,4,5,6,7,8], e.new_cache(), rows=[7]); list(e.generate_ids([1,2,3], max_tokens=2, ignore_eos=True))'
python3 -c 'from llorch_ref.references.llamacpp import LlamaCpp; LlamaCpp("/tmp/smol.gguf", n_ctx=512, kv_dtype="float16", n_threads=2)' > /dev/null 2>&1
timeout 150 python3 -m llorch_ref.cli bench --model /tmp/smol.gguf --engines numba,llamacpp --threads 2 --repeats 5 --interleave --json $OUT/dev44-smol.json 2>&1 | grep -vE '^llorch-ref bench: |by path|registers|^$' | head -12
echo "smol done after $(( $(date +%s) - T0 )) s"; uptime
for T in Q4_0 Q4_K; do
  python3 tools/make_big_model.py --shape llama2-7b --type $T --out /tmp/l7.gguf 2>&1 | tail -1
  python3 -c '
import llorch_ref
e = llorch_ref.load("/tmp/l7.gguf", backend="numba")
e.forward(list(range(1, 9)), e.new_cache(), rows=[7]); list(e.generate_ids(list(range(1, 9)), max_tokens=2, ignore_eos=True))'
  echo "$T warm after $(( $(date +%s) - T0 )) s"
  timeout 200 python3 -m llorch_ref.cli bench --model /tmp/l7.gguf --engines numba,llamacpp --threads 2 --prefill 8 --decode 16 --repeats 5 --interleave --json $OUT/dev44-7b-$T.json 2>&1 | grep -vE '^llorch-ref bench: |by path|registers|^$' | head -12
  rm -f /tmp/l7.gguf
  echo "$T done after $(( $(date +%s) - T0 )) s"; uptime
done
