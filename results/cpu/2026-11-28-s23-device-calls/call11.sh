. .dev/setup.sh > /dev/null 2>&1
python3 -m compileall -q /tmp/site llorch_ref > /dev/null
python3 tools/make_big_model.py --shape smollm2-135m --type Q4_1 --vocab-from .dev/smol-vocab.gguf --out /tmp/smol.gguf 2>/dev/null
python3 -c "import llorch_ref; llorch_ref.load('/tmp/smol.gguf', backend='numba')"
for i in 1 2 3; do echo "== with scipy"; python3 .dev/who_scipy.py /tmp/smol.gguf; echo "== scipy hidden"; python3 .dev/who_scipy.py /tmp/smol.gguf hide; done 2>&1 | grep -v "^openmp"
echo "== with OPENBLAS_NUM_THREADS=2"; OPENBLAS_NUM_THREADS=2 python3 .dev/who_scipy.py /tmp/smol.gguf
