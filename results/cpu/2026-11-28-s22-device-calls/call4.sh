. .dev/setup.sh
bench() { python3 -m llorch_ref.cli bench "$@" 2>&1 | grep -vE '^llorch-ref bench: |by path|registers|^$' ; }
python3 tools/make_big_model.py --shape llama2-7b --type Q4_K --out /tmp/l7-q4k.gguf 2>/dev/null
python3 tools/make_big_model.py --shape smollm2-135m --type Q4_1 --out /tmp/smol.gguf 2>/dev/null
cat /tmp/l7-q4k.gguf > /dev/null
python3 -c "import llorch_ref; llorch_ref.load('/tmp/smol.gguf', backend='numba')"   # compile the kernels once
bench --model /tmp/l7-q4k.gguf --engines numba,llamacpp --threads 2 --prefill 8 --decode 16 --repeats 5 --interleave --json $OUT/dev4-7b-q4k-t2.json
bench --model /tmp/smol.gguf --engines numba,numba-ggml,llamacpp --threads 2 --repeats 3 --interleave --json $OUT/dev4-smol-t2.json
