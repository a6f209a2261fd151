. .dev/setup.sh
git log --oneline | head -1
bench() { python3 -m llorch_ref.cli bench "$@" 2>&1 | grep -v '^llorch-ref bench: ' ; }
python3 tools/make_big_model.py --shape smollm2-135m --type Q4_1 --out /tmp/smol.gguf 2>/dev/null
python3 -c "import llorch_ref; llorch_ref.load('/tmp/smol.gguf', backend='numba')"   # compile the kernels once
bench --model /tmp/smol.gguf --engines numba,numba-ggml,llamacpp --threads 2 --repeats 5 --interleave --json $OUT/dev2-smol-t2.json | tee $OUT/dev2-smol-t2.txt
python3 tools/make_big_model.py --shape llama2-7b --type Q4_K --out /tmp/l7-q4k.gguf 2>/dev/null
cat /tmp/l7-q4k.gguf > /dev/null
bench --model /tmp/l7-q4k.gguf --engines numba,llamacpp --threads 2 --prefill 8 --decode 16 --repeats 5 --interleave --json $OUT/dev2-7b-q4k-t2.json | tee $OUT/dev2-7b-q4k-t2.txt
python3 tools/make_big_model.py --shape llama2-7b --type Q4_0 --out /tmp/l7-q40.gguf 2>/dev/null
cat /tmp/l7-q40.gguf > /dev/null
bench --model /tmp/l7-q40.gguf --engines numba,llamacpp --threads 2 --prefill 8 --decode 16 --repeats 5 --interleave --json $OUT/dev2-7b-q40-t2.json | tee $OUT/dev2-7b-q40-t2.txt
bench --model /tmp/l7-q4k.gguf --engines numba,llamacpp --threads 1 --prefill 8 --decode 16 --repeats 3 --interleave --json $OUT/dev2-7b-q4k-t1.json | tee $OUT/dev2-7b-q4k-t1.txt
