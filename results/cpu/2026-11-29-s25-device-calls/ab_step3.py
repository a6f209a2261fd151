import sys, time, llorch_ref, numpy as np
e = llorch_ref.load("/root/.cache/llorch_ref/models/SmolLM2-135M-Instruct.Q4_1.gguf", backend="numba", numerics="ggml")
ids = e.tokenizer.encode("The history of the world is long and full of surprises. " * 3)
emb = e.weights.tok_embd
acc = [0.0]
class Timed:
    def __getitem__(self, i):
        t = time.perf_counter(); r = emb[i]; acc[0] += time.perf_counter() - t; return r
e.weights.tok_embd = Timed()
out = e.weights.output
acc2 = [0.0]
class TO:
    def __init__(s, m): s.m = m; s.shape = m.shape; s.dtype = m.dtype
    def matmul(s, x):
        t = time.perf_counter(); r = s.m.matmul(x); acc2[0] += time.perf_counter() - t; return r
e.weights.output = TO(out) if hasattr(out, "matmul") else out
c = e.new_cache(); e.forward(ids, c, rows=[len(ids) - 1])
dec = e.backend.make_decoder(e, c)
dec(5); acc[0] = 0; acc2[0] = 0
t = time.perf_counter()
for i in range(100): dec(5 + i)
print(f"step {(time.perf_counter() - t) * 10:.3f} ms, lookup {acc[0] * 10:.3f} ms, output {acc2[0]*10:.3f} ms", type(out).__name__)
