# call 43 (session 30): Q4_0's 8- and 12-token products on the Xeon: this tree (tiles below 16 tokens for 32-weight
# blocks: PANEL_TOKENS = (16, 8)) against the same files with PANEL_TOKENS = (8, 8) (panels from 8), one process
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PYTHONPYCACHEPREFIX=/tmp/pyc
unset PYTHONDONTWRITEBYTECODE
lscpu | grep -E 'Model name'; uptime
T0=$(date +%s)
timeout 500 python3 tools/kernel_ab.py --base llorch_ref/backends --base-set "PANEL_TOKENS=(8, 8)" --types Q4_0 --shapes 4096x11008,11008x4096,4096x4096 --tokens 8,12 --threads 2 2>&1 | grep -v Warn
echo "done after $(( $(date +%s) - T0 )) s"; uptime
