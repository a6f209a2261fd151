import sys, time; T = time.perf_counter
import llorch_ref
e = llorch_ref.load(sys.argv[1], backend="numba", threads=2)
ids = list(range(100, 108))
def once():
    t = T(); list(e.generate_ids(ids, max_tokens=4, ignore_eos=True)); return T() - t
a = once(); b = once(); c = once()
print(f"first request {a:.3f} warm {min(b, c):.3f} extra {a - min(b, c):.3f}")
