# call 21 (session 25): bw.py with kquant_rows' rows in tasks of 16 and the next row prefetched
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD/.dev/noscipy:/tmp/site:$PWD PYTHONUNBUFFERED=1
uptime
python3 results/cpu/2026-11-29-s25-device-calls/bw.py
python3 results/cpu/2026-11-29-s25-device-calls/bw.py
