"""The numpy backend: the oracle's layer functions as they are, their BLAS work handed to cpu_split.

On free cores nothing changes: every product is `x @ w.T` on BLAS's own threads. While other processes hold the
cores, OpenBLAS's spinning threads made the oracle's decode 50x slower with both cores busy at two threads (1.4
tok/s against 71.4 idle, where llama.cpp slowed 3.2x; results/cpu/2026-11-28-s21-busy-cores.md): then, as on the
numba backend, BLAS runs on one thread and products (one token or several) are cut into row panels of the weight,
attention into groups of KV heads, one part a thread of llorch-ref's own (backends/cpu_split.py). The same
operations on the same operands; where OpenBLAS multiplies a panel with another kernel than the whole, an output's
last bits can differ (`LLORCH_BLAS_SPLIT=blas` keeps BLAS's threads whatever the load).
"""
from __future__ import annotations

import types

import numpy as np

from . import Backend, cpu_threads, limit_blas
from .cpu_split import SPLIT, blas_controller


class NumpyBackend(Backend):
    def __init__(self, threads=None):
        n = cpu_threads(threads)
        blas = limit_blas(n)
        SPLIT.configure(n, blas_controller())
        super().__init__("numpy", np, lambda a: a, lambda a: a, "cpu",
                         info={"threads": n, "blas": blas, "blas_split": SPLIT.mode})

    def make_ops(self, base_ops):
        """base_ops with its products and unwatched attention through cpu_split (the reference's arithmetic)."""
        ops = types.SimpleNamespace(**{n: getattr(base_ops, n) for n in dir(base_ops) if not n.startswith("_")})

        def linear(xp, x, w):
            if isinstance(w, np.ndarray) and w.dtype == np.float32:
                return SPLIT.product(x, w)
            return base_ops.linear(xp, x, w)

        def qkv(xp, x, wq, wk, wv, n_heads, n_kv_heads, head_dim):
            t = x.shape[0]
            return (linear(xp, x, wq).reshape(t, n_heads, head_dim), linear(xp, x, wk).reshape(t, n_kv_heads, head_dim),
                    linear(xp, x, wv).reshape(t, n_kv_heads, head_dim))

        def swiglu(xp, x, w_gate, w_up, w_down):
            h = base_ops.silu(xp, linear(xp, x, w_gate)) * linear(xp, x, w_up)
            return linear(xp, h, w_down), h

        def geglu(xp, x, w_gate, w_up, w_down):
            h = base_ops.gelu_tanh(xp, linear(xp, x, w_gate)) * linear(xp, x, w_up)
            return linear(xp, h, w_down), h

        def attention_out(xp, q, k, v, mask, scale, kv_head):
            return SPLIT.attention_out(base_ops.attention, xp, q, k, v, mask, scale, kv_head)

        for name, fn in (("linear", linear), ("qkv", qkv), ("swiglu", swiglu), ("geglu", geglu),
                         ("attention_out", attention_out)):
            setattr(ops, name, fn)
        return ops
