. .dev/setup.sh > /tmp/setup.log 2>&1; grep -E "Model name|numba|CPU\(s\)" /tmp/setup.log
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site512 .whl512/*.whl || exit 1
python3 -m compileall -q /tmp/site /tmp/site512 llorch_ref > /dev/null
export PYTHONPATH=$PWD/.dev/noscipy:/tmp/site512:$PYTHONPATH
python3 --version; python3 -c "import time; from importlib import metadata as m; t=time.perf_counter(); m.entry_points(); print('entry_points', round(time.perf_counter()-t,3), 's over', len(list(m.distributions())), 'distributions')"
python3 tools/make_big_model.py --shape smollm2-135m --type Q4_1 --vocab-from .dev/smol-vocab.gguf --out /tmp/smol.gguf 2>&1 | tail -3
python3 -c "import llorch_ref; llorch_ref.load('/tmp/smol.gguf', backend='numba')"
echo "== load phases, fresh processes"; for i in 1 2 3 4 5 6; do python3 .dev/phases.py /tmp/smol.gguf; done
echo "== numba import, biggest self times"; python3 -X importtime -c "import llorch_ref; import numba" 2>&1 | sed -n '/llorch_ref$/,$p' | sort -t'|' -k1.13 -n -r | head -12
python3 -X importtime -c "import llorch_ref; import numba" 2>&1 | tail -1
echo "== raw python speed"; python3 -c "
import time; T=time.perf_counter
t=T(); d={str(i): i for i in range(200000)}; print('dict of 200k str', round(T()-t,3))"
