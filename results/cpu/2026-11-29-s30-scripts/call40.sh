# call 40 (session 30): the device image's Python has no bytecode for some modules and sets PYTHONDONTWRITEBYTECODE=1:
# which modules a load compiles from source; the load's phases as the image is, then with bytecode written once to a
# cache prefix (as any pip install leaves it); the default-model bench (5 rounds) with that bytecode
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site512 .whl512/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD/.dev/noscipy:/tmp/site512:/tmp/site:$PWD PYTHONUNBUFFERED=1
lscpu | grep -E 'Model name'; uptime
python3 -m compileall -q /tmp/site /tmp/site512 llorch_ref > /dev/null
python3 tools/make_big_model.py --shape smollm2-135m --type Q4_1 --vocab-from .dev/smol-vocab.gguf --out /tmp/smol.gguf > /dev/null 2>&1
python3 -c 'import llorch_ref; e = llorch_ref.load("/tmp/smol.gguf", backend="numba"); e.forward([1,2,3,4,5,6,7,8], e.new_cache(), rows=[7]); list(e.generate_ids([1,2,3], max_tokens=2, ignore_eos=True))'
echo "== as the image is"
python3 .dev/s30/srccompiled.py /tmp/smol.gguf
for i in 1 2 3 4 5; do python3 .dev/s29/phases.py /tmp/smol.gguf; done
echo "== bytecode written once under PYTHONPYCACHEPREFIX=/tmp/pyc"
export PYTHONPYCACHEPREFIX=/tmp/pyc; unset PYTHONDONTWRITEBYTECODE
python3 .dev/s30/srccompiled.py /tmp/smol.gguf | head -1
python3 -c "import llama_cpp, llorch_ref.bench, llorch_ref.cli" 
python3 .dev/s30/srccompiled.py /tmp/smol.gguf
for i in 1 2 3 4 5; do python3 .dev/s29/phases.py /tmp/smol.gguf; done
T0=$(date +%s)
timeout 200 python3 -m llorch_ref.cli bench --model /tmp/smol.gguf --engines numba,llamacpp --threads 2 --repeats 5 --interleave --json $OUT/dev40-smol-bytecode.json 2>&1 | grep -vE '^llorch-ref bench: |by path|registers|^$' | head -8
echo "bench after $(( $(date +%s) - T0 )) s"; uptime
