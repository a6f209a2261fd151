. .dev/setup.sh
bench() { python3 -m llorch_ref.cli bench "$@" 2>&1 | grep -v '^llorch-ref bench: ' ; }
python3 tools/make_big_model.py --shape smollm2-135m --type Q4_1 --out /tmp/smol.gguf
bench --model /tmp/smol.gguf --engines numba,numba-ggml,llamacpp --threads 2 --repeats 5 --interleave --json $OUT/dev-smol-t2.json | tee $OUT/dev-smol-t2.txt
(time python3 tools/make_big_model.py --shape llama2-7b --type Q4_K --out /tmp/l7-q4k.gguf) 2>&1 | tail -4
cat /tmp/l7-q4k.gguf > /dev/null
bench --model /tmp/l7-q4k.gguf --engines numba,llamacpp --threads 2 --prefill 8 --decode 16 --repeats 5 --interleave --json $OUT/dev-7b-q4k-t2.json | tee $OUT/dev-7b-q4k-t2.txt
