import time, sys; T=time.perf_counter
import llorch_ref, numba
from llorch_ref.backends import numba_backend as NB
from llorch_ref.bench import PROMPT
def sigs():
    return {f"{m.__name__.split('.')[-1]}.{n}": len(f.signatures) for m in (NB.K, NB.G) for n, f in vars(m).items() if isinstance(f, numba.core.registry.CPUDispatcher) and f.signatures}
t0=T(); e = llorch_ref.load(sys.argv[1], backend="numba", threads=2); load=T()-t0
ids = e.tokenizer.encode(PROMPT)[:128]
s0 = sigs()
r = []
for i in range(3):
    t=T(); e.forward(ids, e.new_cache(), rows=[127]); p=T()-t
    if i == 0: s1 = sigs()
    t=T(); list(e.generate_ids(ids[:8], max_tokens=16, ignore_eos=True)); d=T()-t
    if i == 0: s2 = sigs()
    r.append((p, d))
print(f"load {load:.3f} prefill cold {r[0][0]:.3f} warm {r[1][0]:.3f} {r[2][0]:.3f} | 8+16 request cold {r[0][1]:.3f} warm {r[1][1]:.3f} {r[2][1]:.3f}")
print("loaded by the first prefill:", {k: v for k, v in s1.items() if s0.get(k) != v}, "by the first request:", {k: v for k, v in s2.items() if s1.get(k) != v})
