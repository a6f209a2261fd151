"""Where a numba load's time goes on this machine: 3 fresh loads timed, then one under cProfile."""
import cProfile, pstats, sys, time
t = time.perf_counter()
import llorch_ref
print(f"import llorch_ref {time.perf_counter() - t:.3f} s")
path = sys.argv[1]
if sys.argv[2:] == ["profile"]:
    pr = cProfile.Profile(); pr.enable()
    llorch_ref.load(path, backend="numba", threads=2)
    pr.disable()
    pstats.Stats(pr).sort_stats("cumulative").print_stats(45)
else:
    t = time.perf_counter()
    llorch_ref.load(path, backend="numba", threads=2)
    print(f"load {time.perf_counter() - t:.3f} s")
