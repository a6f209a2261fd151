"""The default model's load part by part in a fresh process (perf_counter): header, metadata and tokenizer, numba's
and the kernel modules' import (numba first would change its target options: another cache), numba's runtime start (NRT compile), each warm-up kernel's cache load."""
import sys, time
T = time.perf_counter
t0 = T(); import llorch_ref; t_imp = T() - t0
import llorch_ref.loaders.gguf_file as GF
parts = {}
t = T(); r = GF.open_reader(sys.argv[1]); parts["header"] = T() - t
from llorch_ref.backends import numba_wide_vectors
t = T(); numba_wide_vectors(); import numba; parts["numba"] = T() - t
t = T(); import llorch_ref.backends.numba_backend as NB; parts["kernel modules"] = T() - t
from numba.core.registry import cpu_target
from numba.core.runtime import rtsys
t = T(); rtsys.initialize(cpu_target.target_context); parts["nrt start"] = T() - t
for name in ("Q4_1", "Q8_0", "rms_norm_rows", "silu_mul", "rope_one", "attend_one"):
    t = T(); NB.WARM_UP[name]() if name in NB.WARM_UP else NB._warm_type(NB.S.TYPE_CODE[name]); parts[name] = T() - t
t = T(); e = llorch_ref.load(sys.argv[1], backend="numba", threads=2); parts["load (the rest warm)"] = T() - t
print(f"import llorch_ref {t_imp:.3f} | " + " ".join(f"{k} {v:.3f}" for k, v in parts.items()))
