. .dev/setup.sh > /tmp/setup.log 2>&1; grep -E "Model name|numba " /tmp/setup.log
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site512 .whl512/*.whl || exit 1
python3 -m compileall -q /tmp/site /tmp/site512 llorch_ref > /dev/null
export PYTHONPATH=$PWD/.dev/noscipy:/tmp/site512:$PYTHONPATH
git log --oneline -1 2>/dev/null || true
python3 tools/make_big_model.py --shape smollm2-135m --type Q4_1 --vocab-from .dev/smol-vocab.gguf --out /tmp/smol.gguf > /dev/null 2>&1
echo "== cache warm-up (compiles every kernel the runs use)"
python3 -c "
import llorch_ref
for n in ('exact', 'ggml'):
    e = llorch_ref.load('/tmp/smol.gguf', backend='numba', numerics=n)
    ids = e.tokenizer.encode('The history of the world is long and full of surprises. ' * 12)[:128]
    e.forward(ids, e.new_cache(), rows=[127]); list(e.generate_ids(ids[:8], max_tokens=4, ignore_eos=True))
print('warm')"
echo "== load phases, fresh processes"; for i in 1 2 3 4 5; do python3 .dev/phases.py /tmp/smol.gguf; done
echo "== bench vs the AVX-512 wheel, no scipy"
python3 -m llorch_ref.cli bench --model /tmp/smol.gguf --engines numba,numba-ggml,llamacpp --threads 2 --repeats 5 --interleave --json $OUT/dev14-smol-t2-avx512.json 2>&1 | grep -vE '^llorch-ref bench: |by path|registers|^$'
