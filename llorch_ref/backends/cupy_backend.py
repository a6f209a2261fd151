"""CuPy: the same layer functions over `cupy`, weights uploaded once, no host round trip per layer.

float32 by default with TF32 off (CUPY_TF32=0, set before cupy is imported); dtype="float16" stores the
2-D weights in float16 and runs the matrix products in float16 (activations cast per product),
everything else (norms, RoPE, softmax, the residual stream) stays float32.
"""
from __future__ import annotations

import os
import types

from . import Backend
from ..model.cache import visible_mask


class CupyBackend(Backend):
    def __init__(self, dtype="float32"):
        os.environ.setdefault("CUPY_TF32", "0")
        os.environ.setdefault("CUPY_ACCELERATORS", "")     # plain reduction kernels: capturable in a CUDA graph
        import cupy

        dev = cupy.cuda.Device()
        props = cupy.cuda.runtime.getDeviceProperties(dev.id)
        graphs = os.environ.get("LLORCH_CUDA_GRAPHS", "1") != "0"
        super().__init__(name="cupy", xp=cupy, asarray=cupy.asarray, to_numpy=cupy.asnumpy,
                         device=f"cuda:{dev.id} {props['name'].decode()}", dtype=dtype,
                         info={"tf32": os.environ.get("CUPY_TF32"), "cupy": cupy.__version__,
                               "cuda_graphs": graphs})

    def cache_class(self, base_cls):
        return DeviceCache.make(base_cls)

    def make_decoder(self, engine, cache):
        return GraphDecoder(engine, cache)

    def prepare_weights(self, weights, raw_tensors=None):
        cp = self.xp
        if self.dtype == "float32":
            return weights.map(cp.asarray)
        from ..model.weights import LayerWeights, Weights

        def up(a):
            if a is None:                         # absent biases (llama) stay absent
                return None
            return cp.asarray(a, dtype=cp.float16 if a.ndim == 2 else cp.float32)
        return Weights(tok_embd=cp.asarray(weights.tok_embd, dtype=cp.float32),      # embedding rows stay f32
                       layers=[LayerWeights(**{k: up(v) for k, v in vars(lw).items()}) for lw in weights.layers],
                       out_norm=cp.asarray(weights.out_norm), output=up(weights.output))

    def make_ops(self, base_ops):
        """Hot kernels for one-token steps, written without cuBLAS so that a decode step can be captured as a
        CUDA graph (CuPy refuses cuBLAS calls during capture): a warp-per-row GEMV for the linear layers,
        and attention as elementwise products and reductions. Several tokens (prefill) use cuBLAS."""
        cp = self.xp
        ops = types.SimpleNamespace(**{n: getattr(base_ops, n) for n in dir(base_ops) if not n.startswith("_")})
        gemv = _gemv_kernels(cp)

        def linear(xp, x, w):
            if x.shape[0] == 1 and w.ndim == 2:
                y = cp.empty((1, w.shape[0]), dtype=cp.float32)
                k = gemv["f16" if w.dtype == cp.float16 else "f32"]
                n, kdim = w.shape
                k(((n + 7) // 8,), (256,), (w, cp.ascontiguousarray(x[0], dtype=cp.float32), y, cp.int32(n),
                                             cp.int32(kdim)))
                return y
            if w.dtype == cp.float16:
                return (x.astype(cp.float16) @ w.T).astype(cp.float32)
            return x @ w.T

        def qkv(xp, x, wq, wk, wv, h, kv, hd):
            t = x.shape[0]
            return (linear(xp, x, wq).reshape(t, h, hd), linear(xp, x, wk).reshape(t, kv, hd),
                    linear(xp, x, wv).reshape(t, kv, hd))

        def swiglu(xp, x, w_gate, w_up, w_down):
            h = base_ops.silu(xp, linear(xp, x, w_gate)) * linear(xp, x, w_up)
            return linear(xp, h, w_down), h

        def attention(xp, q, k, v, mask, scale, kv_head):
            if q.shape[0] != 1:
                return base_ops.attention(xp, q, k, v, mask, scale, kv_head)
            kh = k[:, kv_head, :]                                                # [S, H, Hd]
            kq = (kh * q[0][None, :, :]).sum(axis=-1).T[:, None, :]             # [H, 1, S]
            probs = base_ops.softmax(xp, kq * xp.float32(scale) + mask)          # [H, 1, S]
            vh = v[:, kv_head, :]                                                # [S, H, Hd]
            out = (probs[:, 0, :].T[:, :, None] * vh).sum(axis=0)               # [H, Hd]
            return out.reshape(1, -1), kq, probs

        ops.linear, ops.qkv, ops.swiglu, ops.attention = linear, qkv, swiglu, attention
        return ops

    def synchronize(self):
        self.xp.cuda.get_current_stream().synchronize()


class DeviceCache:
    """A Cache whose decode steps read the position from device memory, so one decode step has static
    shapes (attention over all n_ctx slots, later ones masked) and can be captured as a CUDA graph.
    Prefill (several tokens) uses the ordinary host-indexed path."""

    @staticmethod
    def make(base_cls):
        class _DeviceCache(base_cls):
            def __init__(self, xp, cfg, n_ctx, kv_dtype="float32", ops=None):
                super().__init__(xp, cfg, n_ctx, kv_dtype=kv_dtype, **({"ops": ops} if ops is not None else {}))
                self.pos_dev = xp.zeros(1, dtype=xp.int64)
                self.k_pos = xp.arange(self.n_ctx)
                self.static = False          # True while a decode step runs on device-side positions

            def reset(self):
                super().reset()
                self.pos_dev[...] = 0

            def rope_rows(self, n_new, local=False):
                if not self.static:
                    return super().rope_rows(n_new, local)
                cos, sin = self.tables(local)
                return cos[self.pos_dev], sin[self.pos_dev]

            def store(self, layer, k, v):
                if not self.static:
                    return super().store(layer, k, v)
                self.k[layer, self.pos_dev] = k.astype(self.kv_dtype)
                self.v[layer, self.pos_dev] = v.astype(self.kv_dtype)
                return (self.k[layer].astype(self.xp.float32, copy=False),
                        self.v[layer].astype(self.xp.float32, copy=False))

            def mask(self, n_new, window=0):
                if not self.static:
                    return super().mask(n_new, window)
                return visible_mask(self.xp, self.pos_dev[:, None], self.k_pos[None, :], window)

            def advance(self, n_new):
                super().advance(n_new)
                if not self.static:
                    self.pos_dev[...] = self.pos
        return _DeviceCache


class GraphDecoder:
    """decode(token) -> logits [1, V] on the device. The first step runs eagerly (it also fills CuPy's memory
    pool with every buffer a step needs, so that capturing allocates nothing new); the second captures one
    whole decode step as a CUDA graph; later steps only copy the token in, replay the graph and bump the
    device position. Nothing else allocates device memory between replays."""

    def __init__(self, engine, cache):
        self.engine, self.cache = engine, cache
        xp = engine.xp
        self.xp = xp
        self.tok = xp.zeros(1, dtype=xp.int64)
        self.graph, self.out, self.steps = None, None, 0
        self.stream = xp.cuda.Stream(non_blocking=True)
        self.use_graph = engine.backend.info.get("cuda_graphs", False)

    def _step(self):
        from ..model import forward as forward_mod

        c = self.cache
        c.static = True
        try:
            return forward_mod.forward(self.xp, self.engine.config, self.engine.weights, self.tok, c, rows=None,
                                       ops=self.engine.ops)
        finally:
            c.static = False

    def __call__(self, token):
        xp, c = self.xp, self.cache
        c.check_room(1)
        with self.stream:
            self.tok[...] = int(token)
            self.steps += 1
            if not self.use_graph or self.steps == 1:
                out = self._step()
            else:
                if self.graph is None:
                    p0 = c.pos
                    try:
                        rt = xp.cuda.runtime
                        mode = getattr(rt, "streamCaptureModeRelaxed", None)
                        self.stream.begin_capture(*(() if mode is None else (mode,)))
                        self.out = self._step()
                        self.graph = self.stream.end_capture()
                    except Exception as e:   # capture unsupported here: run eagerly from now on
                        try:
                            self.stream.end_capture()
                        except Exception:
                            pass
                        self.engine.backend.info["cuda_graphs"] = False
                        self.engine.backend.info["cuda_graphs_error"] = f"{type(e).__name__}: {e}"[:200]
                        self.use_graph = False
                        c.pos = p0
                        self.steps -= 1
                        return self(token)
                    c.pos = p0               # capture only recorded the step; replay it now
                self.graph.launch(self.stream)
                c.pos += 1
                out = self.out
            c.pos_dev += 1
        self.stream.synchronize()
        return out


_GEMV_SRC = r"""
#include <cuda_fp16.h>
template <typename T>
__device__ void gemv(const T* W, const float* x, float* y, int n, int k) {
    int row = blockIdx.x * 8 + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    if (row >= n) return;
    const T* w = W + (size_t)row * k;
    float acc = 0.f;
    for (int i = lane; i < k; i += 32) acc += (float)w[i] * x[i];
    for (int off = 16; off > 0; off >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, off);
    if (lane == 0) y[row] = acc;
}
extern "C" __global__ void gemv_f32(const float* W, const float* x, float* y, int n, int k) { gemv<float>(W, x, y, n, k); }
extern "C" __global__ void gemv_f16(const __half* W, const float* x, float* y, int n, int k) { gemv<__half>(W, x, y, n, k); }
"""
_GEMV = {}


def _gemv_kernels(cp):
    """y[n] = sum_k W[n, k] x[k], one warp per row (float32 accumulation), for float32 or float16 W."""
    if not _GEMV:
        mod = cp.RawModule(code=_GEMV_SRC, options=("-std=c++17",))
        _GEMV["f32"], _GEMV["f16"] = mod.get_function("gemv_f32"), mod.get_function("gemv_f16")
    return _GEMV
