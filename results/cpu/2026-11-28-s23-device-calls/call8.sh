. .dev/setup.sh
echo "== tools"; for t in cc c++ gcc cmake ninja make; do printf "%s: %s\n" $t "$(command -v $t || echo missing)"; done
python3 -c "import cmake, ninja; print('pip cmake', cmake.__file__)" 2>&1 | tail -1
if ! command -v cmake >/dev/null || ! command -v c++ >/dev/null; then echo "no compiler or cmake: stop"; exit 0; fi
mkdir -p /tmp/lltrim && tar xzf .dev/lltrim.tgz -C /tmp/lltrim && cp .dev/llbuild.sh /tmp/lltrim/build.sh
G=$(command -v ninja >/dev/null && echo Ninja || echo "Unix Makefiles"); sed -i "s/-G Ninja/-G \"$G\"/" /tmp/lltrim/build.sh
( cd /tmp/lltrim && time JOBS=16 bash build.sh ) 2>&1 | tail -6 || { tail -30 /tmp/lltrim/build.log; exit 0; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/sitenative .whl512/*.whl || exit 1
cp -a /tmp/lltrim/build/bin/*.so* /tmp/sitenative/llama_cpp/lib/
python3 -m compileall -q /tmp/site /tmp/sitenative llorch_ref > /dev/null
export PYTHONPATH=/tmp/sitenative:$PYTHONPATH
python3 -c "import llama_cpp; print(llama_cpp.llama_print_system_info().decode())"
grep -E "AMX|FP16|march" /tmp/lltrim/build.log | head -5
echo "== ggml numerics tests against the native build"
python3 -m pytest -q -p no:cacheprovider tests/test_ggml_numerics.py -k "not default_model and not k_quant_copies" 2>&1 | grep -E "FAILED|passed|failed" | head -30
python3 tools/make_big_model.py --shape smollm2-135m --type Q4_1 --vocab-from .dev/smol-vocab.gguf --out /tmp/smol.gguf 2>/dev/null
echo "== greedy 64 tokens, numba ggml vs the native build"
python3 - <<'PY'
import numpy as np, llorch_ref
from llorch_ref.references.llamacpp import LlamaCpp
for kv in ("float32", "float16"):
    e = llorch_ref.load('/tmp/smol.gguf', backend='numba', numerics='ggml', kv_dtype=kv)
    ids = e.tokenizer.encode("Once upon a time, there was a little")
    ref = LlamaCpp('/tmp/smol.gguf', n_ctx=256, kv_dtype=kv)
    lg = ref.eval(ids); ours = e.logits(ids)
    print(kv, e.ggml_simd, "prompt logits max abs", float(np.abs(ours - lg).max()))
    ours = list(e.generate_ids(ids, max_tokens=64, ignore_eos=True))
    theirs = LlamaCpp('/tmp/smol.gguf', n_ctx=256, kv_dtype=kv).greedy(ids, 64)
    print(kv, "fused", e.backend.info.get("fused_decode"), "equal", ours == theirs, sum(a == b for a, b in zip(ours, theirs)), "/ 64")
PY
echo "== bench vs the native build"
python3 -m llorch_ref.cli bench --model /tmp/smol.gguf --engines numba,numba-ggml,llamacpp --threads 2 --repeats 3 --interleave --json $OUT/dev8-smol-t2-native.json 2>&1 | grep -vE '^llorch-ref bench: |by path|registers|^$'
