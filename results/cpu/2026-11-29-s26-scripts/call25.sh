# call 25 (session 26): the final code (f6e075a) on the Xeon against the session start (e573803, in .dev/old): the default model's load and its
# first request (first.py: the first 8-token prompt and 4 tokens beyond a warm one), fresh processes alternating; bench
# numba / numba-ggml / llama.cpp (AVX-512 build), 5 rounds (the load now a median of 5 fresh processes)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site512 .whl512/*.whl > /dev/null 2>&1
REPO=$PWD BASE=$PWD/.dev/noscipy:/tmp/site512:/tmp/site
export PYTHONPATH=$BASE:$REPO PYTHONUNBUFFERED=1
lscpu | grep -E 'Model name'; uptime
python3 -m compileall -q /tmp/site /tmp/site512 llorch_ref .dev/old/llorch_ref > /dev/null
python3 tools/make_big_model.py --shape smollm2-135m --type Q4_1 --vocab-from .dev/smol-vocab.gguf --out /tmp/smol.gguf > /dev/null 2>&1
WARM='
import llorch_ref, sys
for n in sys.argv[1:]:
    e = llorch_ref.load("/tmp/smol.gguf", backend="numba", numerics=n)
    ids = e.tokenizer.encode("The history of the world is long and full of surprises. " * 12)[:128]
    e.forward(ids, e.new_cache(), rows=[127]); list(e.generate_ids(ids[:8], max_tokens=4, ignore_eos=True))
print("warm", llorch_ref.__file__)'
python3 -c "$WARM" exact ggml
(cd /tmp && PYTHONPATH=$BASE:$REPO/.dev/old python3 -c "$WARM" exact)
for tree in $REPO/.dev/old $REPO; do (cd /tmp && PYTHONPATH=$BASE:$tree python3 $REPO/.dev/phases.py /tmp/smol.gguf > /dev/null); done
echo "== load, fresh processes, alternating (old = e573803, new = f6e075a)"
for i in 1 2 3 4 5 6 7; do
  echo -n "old "; (cd /tmp && PYTHONPATH=$BASE:$REPO/.dev/old python3 $REPO/.dev/phases.py /tmp/smol.gguf)
  echo -n "new "; (cd /tmp && PYTHONPATH=$BASE:$REPO python3 $REPO/.dev/phases.py /tmp/smol.gguf)
done
echo "== first request beyond a warm one, fresh processes, alternating"
for i in 1 2 3 4 5; do
  echo -n "old "; (cd /tmp && PYTHONPATH=$BASE:$REPO/.dev/old python3 $REPO/.dev/first.py /tmp/smol.gguf)
  echo -n "new "; (cd /tmp && PYTHONPATH=$BASE:$REPO python3 $REPO/.dev/first.py /tmp/smol.gguf)
done
echo "== bench vs the AVX-512 build"
python3 -m llorch_ref.cli bench --model /tmp/smol.gguf --engines numba,numba-ggml,llamacpp --threads 2 --repeats 5 --interleave --json $OUT/dev25-smol-t2-avx512.json 2>&1 | grep -vE '^llorch-ref bench: |by path|registers|^$' | head -9
