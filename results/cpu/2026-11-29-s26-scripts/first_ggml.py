"""numerics ggml on numba: the load, the first prompt's time beyond a second one (a new cache each), the first
generate's beyond a warm one: python first_ggml.py MODEL"""
import sys, time; T = time.perf_counter
import llorch_ref
t = T(); e = llorch_ref.load(sys.argv[1], backend="numba", numerics="ggml", threads=2); tl = T() - t
ids = list(range(100, 108))
def once(n):
    t = T(); list(e.generate_ids(ids, max_tokens=n, ignore_eos=True)); return T() - t
t = T(); e.forward(ids, e.new_cache()); p1 = T() - t
t = T(); e.forward(ids, e.new_cache()); p2 = T() - t
a = once(4); b = min(once(4), once(4))
print(f"load {tl:.3f} first prefill extra {p1 - p2:.3f} first generate extra {a - b:.3f}")
