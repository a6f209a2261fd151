# call 41 (session 30): the load with and without bytecode, alternating fresh processes (A: as the image is,
# PYTHONDONTWRITEBYTECODE=1 and numpy without bytecode; B: bytecode written once under PYTHONPYCACHEPREFIX), llama.cpp's
# load beside each to show the host's phase; then the default-model bench as the image is (5 rounds)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site512 .whl512/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD/.dev/noscipy:/tmp/site512:/tmp/site:$PWD PYTHONUNBUFFERED=1
lscpu | grep -E 'Model name'; uptime
python3 -m compileall -q /tmp/site /tmp/site512 llorch_ref > /dev/null
python3 tools/make_big_model.py --shape smollm2-135m --type Q4_1 --vocab-from .dev/smol-vocab.gguf --out /tmp/smol.gguf > /dev/null 2>&1
python3 -c 'import llorch_ref; e = llorch_ref.load("/tmp/smol.gguf", backend="numba"); e.forward([1,2,3,4,5,6,7,8], e.new_cache(), rows=[7]); list(e.generate_ids([1,2,3], max_tokens=2, ignore_eos=True))'
env -u PYTHONDONTWRITEBYTECODE PYTHONPYCACHEPREFIX=/tmp/pyc python3 -c "import llorch_ref, llama_cpp, llorch_ref.bench, llorch_ref.cli; e = llorch_ref.load('/tmp/smol.gguf', backend='numba')"
LL='import time
from llorch_ref.references.llamacpp import LlamaCpp
t=time.perf_counter(); r=LlamaCpp("/tmp/smol.gguf", n_ctx=512, kv_dtype="float16", n_threads=2); print("llama.cpp load", round(time.perf_counter()-t,3))'
for i in 1 2 3 4 5 6; do
  echo "A $(python3 .dev/s29/phases.py /tmp/smol.gguf) || $(python3 -c "$LL" 2>&1 | tail -1)"
  echo "B $(env -u PYTHONDONTWRITEBYTECODE PYTHONPYCACHEPREFIX=/tmp/pyc python3 .dev/s29/phases.py /tmp/smol.gguf) || $(env -u PYTHONDONTWRITEBYTECODE PYTHONPYCACHEPREFIX=/tmp/pyc python3 -c "$LL" 2>&1 | tail -1)"
done
T0=$(date +%s)
timeout 200 python3 -m llorch_ref.cli bench --model /tmp/smol.gguf --engines numba,llamacpp --threads 2 --repeats 5 --interleave --json $OUT/dev41-smol-image.json 2>&1 | grep -vE '^llorch-ref bench: |by path|registers|^$' | head -8
echo "bench after $(( $(date +%s) - T0 )) s"; uptime
