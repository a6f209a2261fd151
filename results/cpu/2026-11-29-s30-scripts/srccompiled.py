"""Which modules a default-model load compiles from source (no bytecode), and how long each took."""
import sys, time, importlib._bootstrap_external as BE
orig = BE.SourceLoader.source_to_code
took = []
def s2c(self, data, path, *, _optimize=-1):
    t = time.perf_counter(); r = orig(self, data, path, _optimize=_optimize); took.append((time.perf_counter() - t, path)); return r
BE.SourceLoader.source_to_code = s2c
t = time.perf_counter()
import llorch_ref
e = llorch_ref.load(sys.argv[1], backend="numba", threads=2)
print(f"import + load {time.perf_counter() - t:.3f} s; compiled from source: {len(took)} modules, {sum(x for x, _ in took):.3f} s")
for x, p in sorted(took, reverse=True)[:20]:
    print(f"  {x:.3f} {p}")
