import gc
import json
import os
import sys
import time

os.environ.setdefault("CUPY_TF32", "0")
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "tools"))
import cupy as cp
from cupyx.profiler import benchmark
from gpu_run import random_engine

from llorch_ref.config import Config

shapes = {"smol": Config(arch="llama", n_vocab=49152, d_model=576, n_layers=30, n_heads=9, n_kv_heads=3, head_dim=64, d_ff=1536, context_length=2048, rms_eps=1e-5, rope_base=100000.0, rope_dim=64, rope_style="adjacent", tied_output=False),
          "7b": Config(arch="llama", n_vocab=32000, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=32, head_dim=128, d_ff=11008, context_length=4096, rms_eps=1e-5, rope_base=10000.0, rope_dim=128, rope_style="neox", tied_output=False)}
for name, cfg in shapes.items():
    for dtype in ("float16", "float32") if name == "7b" else ("float16",):
        eng = random_engine(cfg, dtype)
        cache = eng.new_cache()
        eng.forward(list(range(1, 9)), cache, rows=[7])
        dec = eng.backend.make_decoder(eng, cache)
        for _ in range(5): dec(5)
        s = dec.stream
        N = 50
        cp.cuda.Device().synchronize(); t0 = time.perf_counter()
        for _ in range(N):
            dec.graph.launch(s); s.synchronize()
        t_graph = (time.perf_counter() - t0) / N
        cp.cuda.Device().synchronize(); t0 = time.perf_counter()
        for _ in range(N): dec(5)
        t_call = (time.perf_counter() - t0) / N
        # per-op timings (eager, one token)
        ops = eng.ops; lw = eng.weights.layers[0]; xp = cp
        x = cp.random.standard_normal((1, cfg.d_model), dtype=cp.float32)
        res = {}
        res["rms_norm"] = benchmark(ops.rms_norm, (xp, x, lw.attn_norm, 1e-5), n_repeat=50).gpu_times.mean()
        res["gemv_q"] = benchmark(ops.linear, (xp, x, lw.wq), n_repeat=50).gpu_times.mean()
        res["gemv_gate"] = benchmark(ops.linear, (xp, x, lw.w_gate), n_repeat=300).gpu_times.mean()
        h = cp.random.standard_normal((1, cfg.d_ff), dtype=cp.float32)
        res["gemv_down"] = benchmark(ops.linear, (xp, h, lw.w_down), n_repeat=50).gpu_times.mean()
        q = cp.random.standard_normal((1, cfg.n_heads, cfg.head_dim), dtype=cp.float32)
        k = cp.zeros((1024, cfg.n_kv_heads, cfg.head_dim), dtype=cp.float32); k[:20] = 1
        m = cp.full((1, 1024), -cp.inf, dtype=cp.float32); m[0, :20] = 0
        kvh = ops.kv_head_of(xp, cfg.n_heads, cfg.n_kv_heads)
        res["attention"] = benchmark(ops.attention, (xp, q, k, k, m, 0.1, kvh), n_repeat=50).gpu_times.mean()
        cos = cp.ones((1, cfg.rope_dim // 2), dtype=cp.float32)
        res["rope"] = benchmark(ops.rope, (xp, q, cos, cos, cfg.rope_style), n_repeat=50).gpu_times.mean()
        res["mask"] = benchmark(cache.mask, (1,), n_repeat=50).gpu_times.mean()
        res["kv_head_of"] = benchmark(ops.kv_head_of, (xp, cfg.n_heads, cfg.n_kv_heads), n_repeat=50).gpu_times.mean()
        res["add"] = benchmark(lambda a, b: a + b, (x, x), n_repeat=50).gpu_times.mean()
        res["logits"] = benchmark(ops.linear, (xp, x, eng.weights.output), n_repeat=50).gpu_times.mean()
        print(json.dumps({"shape": name, "dtype": dtype, "graph_replay_ms": t_graph * 1e3, "decoder_call_ms": t_call * 1e3,
                          **{k: round(float(v) * 1e6, 1) for k, v in res.items()}}), flush=True)
        del eng, dec, cache
        gc.collect()
        cp.get_default_memory_pool().free_all_blocks()

# prefill: 128 tokens, per-op GPU times (7B float32)
cfg = shapes["7b"]
eng = random_engine(cfg, "float32")
ops, lw, xp, T = eng.ops, eng.weights.layers[0], cp, 128
x = cp.random.standard_normal((T, cfg.d_model), dtype=cp.float32)
q = cp.random.standard_normal((T, cfg.n_heads, cfg.head_dim), dtype=cp.float32)
cache = eng.new_cache()
cos, sin = cache.rope_rows(T)
mask = cache.mask(T)
kvh = ops.kv_head_of(xp, cfg.n_heads, cfg.n_kv_heads)
h = cp.random.standard_normal((T, cfg.d_ff), dtype=cp.float32)
res = {"forward_ms": benchmark(lambda: eng.forward(list(range(1, T + 1)), eng.new_cache(), rows=[T - 1]), (), n_repeat=5).gpu_times.mean() * 1e3,
       "rms_norm": benchmark(ops.rms_norm, (xp, x, lw.attn_norm, 1e-5), n_repeat=20).gpu_times.mean(),
       "linear_q": benchmark(ops.linear, (xp, x, lw.wq), n_repeat=20).gpu_times.mean(),
       "linear_gate": benchmark(ops.linear, (xp, x, lw.w_gate), n_repeat=20).gpu_times.mean(),
       "linear_down": benchmark(ops.linear, (xp, h, lw.w_down), n_repeat=20).gpu_times.mean(),
       "rope": benchmark(ops.rope, (xp, q, cos, sin, "neox"), n_repeat=20).gpu_times.mean(),
       "attention": benchmark(ops.attention, (xp, q, q, q, mask, 0.1, kvh), n_repeat=20).gpu_times.mean(),
       "swiglu_act": benchmark(lambda: ops.silu(xp, h) * h, (), n_repeat=20).gpu_times.mean()}
print(json.dumps({"prefill_7b_f32": {k: round(float(v) * 1e6, 1) if k != "forward_ms" else round(float(v), 2) for k, v in res.items()}}), flush=True)
