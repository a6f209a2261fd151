. .dev/setup.sh > /dev/null 2>&1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site512 .whl512/*.whl || exit 1
python3 -m compileall -q /tmp/site /tmp/site512 llorch_ref > /dev/null
export PYTHONPATH=$PWD/.dev/noscipy:/tmp/site512:$PYTHONPATH
python3 -c "import numba, sys; print('scipy in the process:', sys.modules.get('scipy') is not None)"
python3 tools/make_big_model.py --shape smollm2-135m --type Q4_1 --vocab-from .dev/smol-vocab.gguf --out /tmp/smol.gguf 2>/dev/null
python3 -c "import llorch_ref; llorch_ref.load('/tmp/smol.gguf', backend='numba')"
echo "== load, fresh processes, no scipy"; for i in 1 2 3 4 5; do python3 .dev/loadprof.py /tmp/smol.gguf | tail -1; done
echo "== bench vs the AVX-512 wheel, no scipy"
python3 -m llorch_ref.cli bench --model /tmp/smol.gguf --engines numba,numba-ggml,llamacpp --threads 2 --repeats 5 --interleave --json $OUT/dev12-smol-t2-avx512-noscipy.json 2>&1 | grep -vE '^llorch-ref bench: |by path|registers|^$'
