import json
import os
import sys
import time

os.environ.setdefault("CUPY_TF32", "0")
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "tools"))
from gpu_run import random_engine

from llorch_ref.config import Config
from llorch_ref.engine import Engine

cfg = Config(arch="llama", n_vocab=49152, d_model=576, n_layers=30, n_heads=9, n_kv_heads=3, head_dim=64, d_ff=1536, context_length=8192, rms_eps=1e-5, rope_base=100000.0, rope_dim=64, rope_style="adjacent", tied_output=False)
for n_ctx in (1024, 8192):
    eng = random_engine(cfg, "float32")
    eng2 = Engine(cfg, eng.weights, None, backend="cupy", dtype="float32", n_ctx=n_ctx)
    for req in range(3):
        cache = eng2.new_cache()
        eng2.forward(list(range(1, 10)), cache, rows=[8])
        dec = eng2.backend.make_decoder(eng2, cache)
        ts = []
        for _ in range(20):
            t = time.perf_counter(); dec(5); ts.append((time.perf_counter() - t) * 1e3)
        print(json.dumps({"n_ctx": n_ctx, "request": req, "step1_ms": round(ts[0], 1), "step2_capture_ms": round(ts[1], 1), "replay_ms_median": round(sorted(ts[2:])[9], 2)}), flush=True)
    del eng, eng2
