import time, llorch_ref
from llorch_ref.engine import GenerationResult
e = llorch_ref.load(numerics='ggml', backend='numba', threads=2)
ids = e.tokenizer.encode("Once upon a time, there was a little")
best = 0
for r in range(4):
    res = GenerationResult()
    for _ in e.generate_ids(ids, max_tokens=64, ignore_eos=True, result=res): pass
    best = max(best, 64 / res.decode_s)
print(f"{best:.1f}")
