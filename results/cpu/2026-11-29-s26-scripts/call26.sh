# call 26 (session 26): the final code (c216543) on the Xeon: numba-ggml's first prompt (first_ggml.py, 3 fresh
# processes), the default model's load (phases.py, 5), then bench numba / numba-ggml / llama.cpp (AVX-512 build), 5 rounds
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site512 .whl512/*.whl > /dev/null 2>&1
REPO=$PWD BASE=$PWD/.dev/noscipy:/tmp/site512:/tmp/site
export PYTHONPATH=$BASE:$REPO PYTHONUNBUFFERED=1
lscpu | grep -E 'Model name'; uptime
python3 -m compileall -q /tmp/site /tmp/site512 llorch_ref > /dev/null
python3 tools/make_big_model.py --shape smollm2-135m --type Q4_1 --vocab-from .dev/smol-vocab.gguf --out /tmp/smol.gguf > /dev/null 2>&1
python3 -c '
import llorch_ref, sys
for n in ("exact", "ggml"):
    e = llorch_ref.load("/tmp/smol.gguf", backend="numba", numerics=n)
    ids = e.tokenizer.encode("The history of the world is long and full of surprises. " * 12)[:128]
    e.forward(ids, e.new_cache(), rows=[127]); list(e.generate_ids(ids[:8], max_tokens=4, ignore_eos=True))
print("warm")'
(cd /tmp && python3 $REPO/.dev/first_ggml.py /tmp/smol.gguf > /dev/null)
echo "== numba-ggml first prompt, fresh processes"; for i in 1 2 3; do (cd /tmp && python3 $REPO/.dev/first_ggml.py /tmp/smol.gguf); done
echo "== numba load, fresh processes"; for i in 1 2 3 4 5; do (cd /tmp && python3 $REPO/.dev/phases.py /tmp/smol.gguf); done
echo "== bench vs the AVX-512 build"
python3 -m llorch_ref.cli bench --model /tmp/smol.gguf --engines numba,numba-ggml,llamacpp --threads 2 --repeats 5 --interleave --json $OUT/dev26-smol-t2-avx512.json 2>&1 | grep -vE '^llorch-ref bench: |by path|registers|^$' | head -9
