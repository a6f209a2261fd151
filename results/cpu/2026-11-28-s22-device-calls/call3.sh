. .dev/setup.sh
bench() { python3 -m llorch_ref.cli bench "$@" 2>&1 | grep -E '^\| llo|^\| lla|^interleaved|^host speed' ; }
python3 tools/make_big_model.py --shape llama2-7b --type Q4_K --out /tmp/l7-q4k.gguf 2>/dev/null
cat /tmp/l7-q4k.gguf > /dev/null
python3 -c "
import llorch_ref, numba
e = llorch_ref.load('/tmp/l7-q4k.gguf', backend='numba', threads=2)
e.forward([1, 2, 3], e.new_cache())
print('threading layer', numba.threading_layer())"
for s in 1000 30000 300000 1000; do echo "GOMP_SPINCOUNT=$s"; GOMP_SPINCOUNT=$s bench --model /tmp/l7-q4k.gguf --engines numba,llamacpp --threads 2 --prefill 8 --decode 16 --repeats 3 --interleave --json $OUT/dev3-7b-q4k-spin$s-$RANDOM.json; done
