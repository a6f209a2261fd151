import sys, time, llorch_ref, numpy as np
e = llorch_ref.load("/root/.cache/llorch_ref/models/SmolLM2-135M-Instruct.Q4_1.gguf", backend="numba", numerics="ggml")
ids = e.tokenizer.encode("The history of the world is long and full of surprises. " * 3)
res = []
for _ in range(5):
    c = e.new_cache(); e.forward(ids, c, rows=[len(ids) - 1])
    dec = e.backend.make_decoder(e, c)
    dec(5)
    t = time.perf_counter()
    for i in range(100): dec(5 + i)
    res.append((time.perf_counter() - t) * 10)
    x = np.asarray([5])
t = time.perf_counter()
for i in range(1000): e.weights.tok_embd[np.asarray([i])]
print(f"step ms min {min(res):.3f} median {sorted(res)[2]:.3f}; lookup us {(time.perf_counter() - t) * 1e3:.1f}")
