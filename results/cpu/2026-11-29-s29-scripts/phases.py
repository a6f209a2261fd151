import sys, time, functools
T = time.perf_counter
t0 = T(); import llorch_ref; t_imp = T() - t0
import llorch_ref.engine as E, llorch_ref.loaders.gguf_file as GF
acc = {}
def wrap(mod, name):
    f = getattr(mod, name)
    @functools.wraps(f)
    def g(*a, **k):
        t = T(); r = f(*a, **k); acc[name] = acc.get(name, 0) + T() - t; return r
    setattr(mod, name, g)
wrap(GF, "open_reader"); wrap(llorch_ref, "from_gguf_metadata"); wrap(E, "get_backend")
t = T(); e = llorch_ref.load(sys.argv[1], backend="numba", threads=2); tot = T() - t
print(f"import {t_imp:.3f} load {tot:.3f} | " + " ".join(f"{k} {v:.3f}" for k, v in acc.items()) +
      f" | other {tot - sum(acc.values()):.3f} | backend says {e.backend.info.get('compile_or_cache_load_s')}")
