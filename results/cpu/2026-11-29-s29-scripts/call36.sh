# call 36 (session 29): the final code on the Xeon. (1) K-quant 8- and 12-token products on 7B widths: panels
# (PANEL_TOKENS (16, 8), this tree) against the tiles (the same files with (16, 16): .dev/s29/base), in one process;
# (2) a Llama-2-7B-shaped Q4_K file at the must-show shape (prefill 8, decode 16), numba / llama.cpp, 5 rounds;
# (3) the default model's shape, numba / llama.cpp, 5 rounds; (4) the load's phases in 5 fresh processes
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site512 .whl512/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD/.dev/noscipy:/tmp/site512:/tmp/site:$PWD PYTHONUNBUFFERED=1
lscpu | grep -E 'Model name'; uptime
python3 -m compileall -q /tmp/site /tmp/site512 llorch_ref > /dev/null
T0=$(date +%s)
(cd .dev/s29 && timeout 170 python3 ab2.py tiles Q4_K,Q6_K 4096x11008,11008x4096,4096x4096 8,12 2 2>&1 | grep -v Warn)
echo "ab done after $(( $(date +%s) - T0 )) s"
python3 tools/make_big_model.py --shape llama2-7b --type Q4_K --out /tmp/l7-Q4_K.gguf 2>&1 | tail -1
python3 -c '
import llorch_ref
e = llorch_ref.load("/tmp/l7-Q4_K.gguf", backend="numba")
e.forward(list(range(1, 9)), e.new_cache(), rows=[7]); list(e.generate_ids(list(range(1, 9)), max_tokens=2, ignore_eos=True))
print("warm")'
echo "warm after $(( $(date +%s) - T0 )) s"; uptime
timeout 200 python3 -m llorch_ref.cli bench --model /tmp/l7-Q4_K.gguf --engines numba,llamacpp --threads 2 --prefill 8 --decode 16 --repeats 5 --interleave --json $OUT/dev36-7b-q4k.json 2>&1 | grep -vE '^llorch-ref bench: |by path|registers|^$' | head -8
rm -f /tmp/l7-Q4_K.gguf
echo "7b done after $(( $(date +%s) - T0 )) s"
python3 tools/make_big_model.py --shape smollm2-135m --type Q4_1 --vocab-from .dev/smol-vocab.gguf --out /tmp/smol.gguf > /dev/null 2>&1
for i in 1 2 3 4 5; do python3 .dev/s29/phases.py /tmp/smol.gguf; done
timeout 130 python3 -m llorch_ref.cli bench --model /tmp/smol.gguf --engines numba,llamacpp --threads 2 --repeats 5 --interleave --json $OUT/dev36-smol.json 2>&1 | grep -vE '^llorch-ref bench: |by path|registers|^$' | head -8
echo "all done after $(( $(date +%s) - T0 )) s"
