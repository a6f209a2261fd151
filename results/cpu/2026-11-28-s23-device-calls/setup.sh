# sourced by each device call: install the carried wheels, name the machine
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
lscpu | grep -E 'Model name|^CPU\(s\)|Thread|Core|Socket|NUMA node|L2|L3|MHz' 
python3 -c "import numba, llvmlite, numpy, llama_cpp, gguf; print('numba', numba.__version__, 'llvmlite', llvmlite.__version__, 'numpy', numpy.__version__, 'llama_cpp', llama_cpp.__version__)"
env | grep -E 'OPENBLAS|OMP|NUMBA' 
uptime
