# call 39 (session 30): where the default model's load goes on the Xeon: interpreter start, numba's import, phases,
# a profile, the effect of numba's pool size (NUMBA_NUM_THREADS), llama.cpp's load beside it
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site512 .whl512/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD/.dev/noscipy:/tmp/site512:/tmp/site:$PWD PYTHONUNBUFFERED=1
lscpu | grep -E 'Model name|^CPU\(s\)'; uptime; env | grep -E 'PYTHONDONT|NUMBA|OMP|OPENBLAS'
python3 -c "import importlib.metadata as m; print('dists', len(list(m.distributions())))"
python3 -m compileall -q /tmp/site /tmp/site512 llorch_ref > /dev/null
python3 tools/make_big_model.py --shape smollm2-135m --type Q4_1 --vocab-from .dev/smol-vocab.gguf --out /tmp/smol.gguf > /dev/null 2>&1
python3 -c 'import llorch_ref; e = llorch_ref.load("/tmp/smol.gguf", backend="numba"); e.forward([1,2,3,4,5,6,7,8], e.new_cache(), rows=[7]); list(e.generate_ids([1,2,3], max_tokens=2, ignore_eos=True))'
for i in 1 2 3; do /usr/bin/time -f "python -c pass %e s" python3 -c pass; done
for i in 1 2 3; do python3 -X importtime -c "import numba" 2>&1 | tail -1; python3 -X importtime -c "import numpy" 2>&1 | tail -1; done
for i in 1 2 3 4 5; do python3 .dev/s29/phases.py /tmp/smol.gguf; done
for i in 1 2 3 4 5; do NUMBA_NUM_THREADS=2 python3 .dev/s29/phases.py /tmp/smol.gguf; done
for i in 1 2 3; do python3 .dev/phases2.py /tmp/smol.gguf; done
python3 -c "
import cProfile, pstats, llorch_ref
cProfile.run('llorch_ref.load(\"/tmp/smol.gguf\", backend=\"numba\", threads=2)', '/tmp/load.prof')
p=pstats.Stats('/tmp/load.prof'); p.sort_stats('cumulative').print_stats(40)" | grep -E '^ +[0-9]' | head -40
python3 -c "
import cProfile, pstats, llorch_ref
cProfile.run('llorch_ref.load(\"/tmp/smol.gguf\", backend=\"numba\", threads=2)', '/tmp/load.prof')
p=pstats.Stats('/tmp/load.prof'); p.sort_stats('tottime').print_stats(25)" | grep -E '^ +[0-9]' | head -25
for i in 1 2 3; do python3 -c "
import time
from llorch_ref.references.llamacpp import LlamaCpp
t=time.perf_counter(); r=LlamaCpp('/tmp/smol.gguf', n_ctx=512, kv_dtype='float16', n_threads=2); print('llama.cpp load', round(time.perf_counter()-t,3))" 2>&1 | tail -1; done
uptime
