# call 31 (session 28): the float-tile prototype (weights decoded once into a per-thread panel) against matmul_rows
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD/.dev/noscipy:/tmp/site:$PWD PYTHONUNBUFFERED=1
lscpu | grep -E 'Model name|^Flags' | cut -c1-300; uptime; nproc
cd .dev/s28
for tl in 2x4x4 4x3x4 2x3x4 2x2x4; do echo "== tile $tl"
TILE=$tl timeout 150 python3 ab.py Q4_1,Q8_0 1536x576,576x1536 128,16 2 2>&1 | grep -v Warn
TILE=$tl timeout 150 python3 ab.py Q4_0,Q4_K,Q6_K 4096x4096 8,64 2 2>&1 | grep -v Warn
done
