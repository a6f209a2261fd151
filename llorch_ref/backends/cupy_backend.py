"""CuPy: the same layer functions over `cupy`, weights uploaded once, no host round trip per layer.

float32 by default with TF32 off (CUPY_TF32=0, set before cupy is imported); dtype="float16" stores the
2-D weights in float16 and runs the matrix products in float16 (activations cast per product),
everything else (norms, RoPE, softmax, the residual stream) stays float32.
"""
from __future__ import annotations

import os
import types

from . import Backend


class CupyBackend(Backend):
    def __init__(self, dtype="float32"):
        os.environ.setdefault("CUPY_TF32", "0")
        import cupy

        dev = cupy.cuda.Device()
        props = cupy.cuda.runtime.getDeviceProperties(dev.id)
        super().__init__(name="cupy", xp=cupy, asarray=cupy.asarray, to_numpy=cupy.asnumpy,
                         device=f"cuda:{dev.id} {props['name'].decode()}", dtype=dtype,
                         info={"tf32": os.environ.get("CUPY_TF32"), "cupy": cupy.__version__})

    def prepare_weights(self, weights, raw_tensors=None):
        cp = self.xp
        if self.dtype == "float32":
            return weights.map(cp.asarray)
        from ..model.weights import LayerWeights, Weights

        def up(a):
            return cp.asarray(a, dtype=cp.float16 if a.ndim == 2 else cp.float32)
        return Weights(tok_embd=cp.asarray(weights.tok_embd, dtype=cp.float32),      # embedding rows stay f32
                       layers=[LayerWeights(**{k: up(v) for k, v in vars(lw).items()}) for lw in weights.layers],
                       out_norm=cp.asarray(weights.out_norm), output=up(weights.output))

    def make_ops(self, base_ops):
        if self.dtype == "float32":
            return base_ops
        cp = self.xp
        ops = types.SimpleNamespace(**{n: getattr(base_ops, n) for n in dir(base_ops) if not n.startswith("_")})

        def linear(xp, x, w):
            if w.dtype == cp.float16:
                return (x.astype(cp.float16) @ w.T).astype(cp.float32)
            return x @ w.T
        ops.linear = linear
        ops.qkv = lambda xp, x, wq, wk, wv, h, kv, hd: (
            linear(xp, x, wq).reshape(x.shape[0], h, hd), linear(xp, x, wk).reshape(x.shape[0], kv, hd),
            linear(xp, x, wv).reshape(x.shape[0], kv, hd))

        def swiglu(xp, x, w_gate, w_up, w_down):
            h = base_ops.silu(xp, linear(xp, x, w_gate)) * linear(xp, x, w_up)
            return linear(xp, h, w_down), h
        ops.swiglu = swiglu
        return ops

    def synchronize(self):
        self.xp.cuda.get_current_stream().synchronize()
