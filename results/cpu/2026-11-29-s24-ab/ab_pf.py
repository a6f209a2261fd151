import time, llorch_ref
e = llorch_ref.load(numerics='ggml', backend='numba', threads=2)
ids = (e.tokenizer.encode("Once upon a time, there was a little girl who lived in a village near the forest. ") * 20)[:128]
best = 0
for r in range(4):
    t = time.perf_counter(); e.forward(ids, e.new_cache(), rows=[127]); best = max(best, 128 / (time.perf_counter() - t))
print(f"{best:.1f}")
