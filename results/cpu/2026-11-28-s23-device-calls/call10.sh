. .dev/setup.sh
python3 -m compileall -q /tmp/site llorch_ref > /dev/null
python3 tools/make_big_model.py --shape smollm2-135m --type Q4_1 --vocab-from .dev/smol-vocab.gguf --out /tmp/smol.gguf 2>/dev/null
python3 -c "import llorch_ref; llorch_ref.load('/tmp/smol.gguf', backend='numba')"
python3 .dev/who_scipy.py /tmp/smol.gguf 2>&1 | head -80
