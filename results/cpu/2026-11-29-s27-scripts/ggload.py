import sys, time
T=time.perf_counter
t0=T(); import llorch_ref; ti=T()-t0
t=T(); e = llorch_ref.load(sys.argv[1], backend="numba", threads=2, numerics=sys.argv[2]); tl=T()-t
print(f"{sys.argv[2]}: import {ti:.3f} load {tl:.3f}")
