import time, sys
T = time.perf_counter
t = T()
import llorch_ref
e = llorch_ref.load("/root/.cache/llorch_ref/models/SmolLM2-135M-Instruct.Q4_1.gguf", backend="numba", numerics=sys.argv[1] if len(sys.argv) > 1 else "exact")
t1 = T(); c = e.new_cache(); ids = e.tokenizer.encode("Hello there, how"); e.forward(ids, c, rows=[len(ids) - 1])
t2 = T(); d = e.backend.make_decoder(e, c); d(5)
t3 = T()
print(f"load {t1 - t:.1f} prefill {t2 - t1:.1f} first decode {t3 - t2:.1f}")
