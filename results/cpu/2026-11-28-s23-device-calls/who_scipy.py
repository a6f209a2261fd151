"""On the GPU host: which import brings a second BLAS into a numba engine's process, and what it costs in RSS."""
import builtins, os, sys, traceback

def rss():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6

seen = {}
real = builtins.__import__
def hook(name, *a, **k):
    if name.split(".")[0] in ("scipy", "torch", "sklearn") and name not in seen:
        seen[name] = 1
        if name == "scipy":
            print(f"-- first import of scipy (rss {rss():.0f} MB)", flush=True)
    return real(name, *a, **k)
builtins.__import__ = hook
if sys.argv[2:] == ["hide"]:
    sys.modules["scipy"] = None       # numba's import then finds no scipy (a test of its cost only)
print(f"start rss {rss():.0f} MB")
import time
t0 = time.perf_counter()
import llorch_ref
print(f"after import llorch_ref {rss():.0f} MB")
e = llorch_ref.load(sys.argv[1], backend="numba", threads=2)
print(f"after load {rss():.0f} MB, load+import {time.perf_counter() - t0:.2f} s")
e.forward(list(range(1, 129)), e.new_cache(), rows=[127])
print(f"after a 128-token prompt {rss():.0f} MB")
from threadpoolctl import threadpool_info
for x in threadpool_info():
    print(x.get("user_api"), x.get("internal_api"), x.get("version"), x.get("num_threads"), x.get("filepath"))
print("scipy loaded:", "scipy" in sys.modules, "torch loaded:", "torch" in sys.modules)
