. .dev/setup.sh
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site512 .whl512/*.whl || exit 1
bench() { python3 -m llorch_ref.cli bench "$@" 2>&1 | grep -vE '^llorch-ref bench: |by path|registers|^$' ; }
git log --oneline -1 2>/dev/null
python3 tools/make_big_model.py --shape smollm2-135m --type Q4_1 --out /tmp/smol.gguf 2>/dev/null
python3 tools/make_big_model.py --shape llama2-7b --type Q4_K --out /tmp/l7-q4k.gguf 2>/dev/null
cat /tmp/l7-q4k.gguf > /dev/null
python3 -c "import llorch_ref; llorch_ref.load('/tmp/smol.gguf', backend='numba')"   # compile the kernels once
echo "== load, fresh processes"; for i in 1 2 3; do python3 .dev/loadprof.py /tmp/smol.gguf; done
echo "== load profile"; python3 .dev/loadprof.py /tmp/smol.gguf profile 2>&1 | head -80
echo "== smol vs AVX2 wheel"
bench --model /tmp/smol.gguf --engines numba,numba-ggml,llamacpp --threads 2 --repeats 5 --interleave --json $OUT/dev5-smol-t2.json
echo "== smol vs AVX-512 wheel"
PYTHONPATH=/tmp/site512:$PYTHONPATH bench --model /tmp/smol.gguf --engines numba,numba-ggml,llamacpp --threads 2 --repeats 5 --interleave --json $OUT/dev5-smol-t2-avx512.json
echo "== 7B Q4_K vs AVX-512 wheel"
PYTHONPATH=/tmp/site512:$PYTHONPATH bench --model /tmp/l7-q4k.gguf --engines numba,llamacpp --threads 2 --prefill 8 --decode 16 --repeats 5 --interleave --json $OUT/dev5-7b-q4k-t2-avx512.json
