# call 33 (session 28): the final panels (chunked, c316981+) on the Xeon: a 128-token prefill's profile, then the
# default model's shape with its vocabulary, bench numba / numba-ggml / llama.cpp (the AVX-512 build), 5 rounds, twice
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site512 .whl512/*.whl > /dev/null 2>&1
REPO=$PWD
export PYTHONPATH=$PWD/.dev/noscipy:/tmp/site512:/tmp/site:$PWD PYTHONUNBUFFERED=1
lscpu | grep -E 'Model name' ; uptime
python3 -m compileall -q /tmp/site /tmp/site512 llorch_ref > /dev/null
python3 tools/make_big_model.py --shape smollm2-135m --type Q4_1 --vocab-from .dev/smol-vocab.gguf --out /tmp/smol.gguf > /dev/null 2>&1
python3 -c '
import llorch_ref
for n in ("exact", "ggml"):
    e = llorch_ref.load("/tmp/smol.gguf", backend="numba", numerics=n)
    ids = e.tokenizer.encode("The history of the world is long and full of surprises. " * 12)[:128]
    e.forward(ids, e.new_cache(), rows=[127]); list(e.generate_ids(ids[:8], max_tokens=4, ignore_eos=True))
print("warm")'
python3 .dev/s28/prof.py /tmp/smol.gguf 2>&1 | head -28
echo "== numba load, fresh processes"; for i in 1 2 3; do (cd /tmp && python3 $REPO/.dev/phases.py /tmp/smol.gguf); done
for r in 1 2; do
echo "== bench $r vs the AVX-512 build"; uptime
python3 -m llorch_ref.cli bench --model /tmp/smol.gguf --engines numba,numba-ggml,llamacpp --threads 2 --repeats 5 --interleave --json $OUT/dev33-smol-t2-avx512-$r.json 2>&1 | grep -vE '^llorch-ref bench: |by path|registers|^$' | head -9
done
