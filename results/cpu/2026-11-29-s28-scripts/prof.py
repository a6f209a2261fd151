import cProfile, pstats, time, sys
import numpy as np
import llorch_ref
e = llorch_ref.load(sys.argv[1] if len(sys.argv) > 1 else None, backend="numba", threads=2)
ids = e.tokenizer.encode("The history of the world is long and full of surprises. " * 12)[:128]
for _ in range(3): e.forward(ids, e.new_cache(), rows=[127])
ts=[]
for _ in range(7):
    t=time.perf_counter(); e.forward(ids, e.new_cache(), rows=[127]); ts.append(time.perf_counter()-t)
print("forward median", sorted(ts)[3])
pr=cProfile.Profile(); pr.enable()
for _ in range(5): e.forward(ids, e.new_cache(), rows=[127])
pr.disable()
pstats.Stats(pr).sort_stats("tottime").print_stats(18)
