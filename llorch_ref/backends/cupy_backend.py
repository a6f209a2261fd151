"""CuPy: the same layer functions over `cupy`, weights uploaded once, no host round trip per layer.

float32 by default with TF32 off (CUPY_TF32=0, set before cupy is imported); dtype="float16" stores the
2-D weights in float16 and runs the matrix products in float16 (activations cast per product),
everything else (norms, RoPE, softmax, the residual stream) stays float32. dtype="blocks" keeps quantized
matrices as the file's GGUF blocks on the device and multiplies them by cuda_blocks' kernels.
"""
from __future__ import annotations

import dataclasses
import os

import numpy as np

from ..errors import ParameterError
from ..model.cache import visible_mask
from ..model.weights import LayerWeights, Weights
from . import Backend
from .cuda_blocks import TYPES as BLOCK_TYPES
from .cuda_blocks import GpuBlocks
from .cuda_fused import FusedStep
from .cuda_ops import CudaOps, joined
from .cuda_ops import kernels as _kernels
from .fused_forward import forward as fused_forward
from .settings import settings


class CupyBackend(Backend):
    def __init__(self, dtype="float32"):
        os.environ.setdefault("CUPY_TF32", "0")
        os.environ.setdefault("CUPY_ACCELERATORS", "")     # plain reduction kernels: capturable in a CUDA graph
        import cupy

        dev = cupy.cuda.Device()
        props = cupy.cuda.runtime.getDeviceProperties(dev.id)
        graphs = settings().cuda_graphs
        super().__init__(name="cupy", xp=cupy, asarray=cupy.asarray, to_numpy=cupy.asnumpy,
                         device=f"cuda:{dev.id} {props['name'].decode()}", dtype=dtype,
                         info={"tf32": os.environ.get("CUPY_TF32"), "cupy": cupy.__version__,
                               "cuda_graphs": graphs})
        self.step_argmax = {}     # a replayed graph's logits (data address) -> (logits, ring, slot of its argmax)

    def cache_class(self, base_cls):
        return DeviceCache.make(base_cls)

    def make_decoder(self, engine, cache):
        return GraphDecoder(engine, cache)

    def prepare_weights(self, weights, qtensors=None, numerics="exact"):
        """float32: every array uploaded; float16: 2-D weights stored in float16; blocks: every matrix with a
        QTensor of a type cuda_blocks multiplies (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K) uploaded as its blocks, the
        rest in float32. Then each layer's Q/K/V and gate/up matrices are stacked in one allocation (the
        fields stay views of it), so that a decode step reads each group with one kernel (joined)."""
        cp = self.xp
        if self.dtype == "blocks":
            weights = self._blocks_weights(weights, qtensors or {})
        elif self.dtype == "float32":
            weights = weights.map(cp.asarray)
        else:
            def up(a):
                if a is None:                         # absent biases (llama) stay absent
                    return None
                return cp.asarray(a, dtype=cp.float16 if a.ndim == 2 else cp.float32)
            weights = Weights(tok_embd=cp.asarray(weights.tok_embd, dtype=cp.float32),  # embedding rows stay f32
                              layers=[LayerWeights(**{k: up(v) for k, v in vars(lw).items()}) for lw in weights.layers],
                              out_norm=cp.asarray(weights.out_norm), output=up(weights.output))
        for lw in weights.layers:
            for group in (("wq", "wk", "wv"), ("w_gate", "w_up")):
                parts = stacked([getattr(lw, f) for f in group], cp)
                if parts is not None:
                    for f, v in zip(group, parts):
                        setattr(lw, f, v)
        return weights

    def _blocks_weights(self, weights, qtensors):
        cp = self.xp
        gpu = {k: GpuBlocks.from_qtensor(q, cp) for k, q in qtensors.items() if q.qtype in BLOCK_TYPES}
        made = [v for lw in weights.layers for v in vars(lw).values() if isinstance(v, GpuBlocks)]
        if not gpu and made:                  # weights built on the device (random models of tools/)
            self.info["blocks_mb"] = round(sum(g.nbytes for g in made) / 2**20, 1)
            return weights
        if not gpu:
            kinds = sorted({q.qtype for q in qtensors.values()}) or ["none (a float file)"]
            raise ParameterError(f"--dtype blocks needs quantized matrices of a type the GPU kernels read "
                                 f"({', '.join(BLOCK_TYPES)}); this model's: {', '.join(kinds)}")
        self.info["blocks_mb"] = round(sum(g.nbytes for g in gpu.values()) / 2**20, 1)
        self.info["blocks_types"] = sorted({g.qtype for g in gpu.values()})

        def up(a):
            return None if a is None else cp.asarray(a)

        def field(i, name):                 # lazy weights: only what the GPU does not read as blocks
            if (i, name) in gpu:
                return gpu[(i, name)]
            return up(weights.layers.field(i, name) if weights.lazy else getattr(weights.layers[i], name, None))
        names = [f.name for f in dataclasses.fields(LayerWeights)]
        layers = []
        for i in range(len(weights.layers)):
            got = {}
            for name in names:
                try:
                    got[name] = field(i, name)
                except AttributeError:      # a field this model does not have (biases, QK-norm)
                    got[name] = None
            layers.append(LayerWeights(**got))
        emb = weights.tok_embd
        emb = emb[np.arange(emb.shape[0])] if weights.lazy else emb
        output = gpu.get("output")
        return Weights(tok_embd=cp.asarray(emb, dtype=cp.float32), layers=layers, out_norm=cp.asarray(weights.out_norm),
                       output=output if output is not None else up(weights.output))

    def make_ops(self, base_ops):
        """-> CudaOps over base_ops (cuda_ops: the hot layer functions as CUDA kernels and cuBLAS products)."""
        return CudaOps(base_ops, self.xp, self.dtype)

    def forward(self, xp, cfg, weights, tokens, cache, ops, rows=None, boundary=None):
        """Where nobody watches: the reference's steps with the fusions of make_ops (the residual add with the next
        RMSNorm; with float16 weights, RoPE, the cache write and attention of a prompt, and activations that only
        feed float16 products carried in float16; with blocks, prompts' products dequantized into float16 for
        tensor cores, and the float16 attention)."""
        ops.unwatched = True
        try:
            return fused_forward(xp, cfg, weights, tokens, cache, ops, ops.fusions, rows=rows, boundary=boundary)
        finally:
            ops.unwatched = False

    def synchronize(self):
        self.xp.cuda.get_current_stream().synchronize()

    def argmax(self, logits) -> int:
        """On the device (argmax_row, np.argmax's answer on ties and NaN: tests/test_backends.py), written into
        host memory the GPU maps: one launch and a wait instead of the whole row copied back (CuPy's own argmax
        costs more than the copy)."""
        cp = self.xp
        # logits a replayed decode graph just made carry the argmax it took (the entry holds them alive, so their
        # address is theirs; nothing writes into a step's logits); the first argmax after the replay consumes it
        done = self.step_argmax.pop(logits.data.ptr, None)
        if done is not None and logits.size == done[0].size and logits.dtype == done[0].dtype:
            return int(done[1].host[done[2]])
        if getattr(self, "_argmax_host", None) is None:
            self._argmax_host = MappedHost(cp, 1, np.int64)
        x = cp.ascontiguousarray(logits, dtype=cp.float32).reshape(-1)
        _kernels(cp)["argmax_row"]((1,), (1024,), (x, np.int32(x.size), self._argmax_host.device))
        cp.cuda.get_current_stream().synchronize()
        return int(self._argmax_host.host[0])


def stacked(ws, cp):
    """Matrices of one kind and input size (float arrays of one dtype, or GpuBlocks of one type) -> the same
    matrices as views of one stacked allocation (rows of ws[0], then ws[1], ...), or None."""
    if all(isinstance(w, GpuBlocks) for w in ws) and len({(w.qtype, w.fmt, w.shape[1]) for w in ws}) == 1:
        joined = GpuBlocks(ws[0].qtype, (sum(w.shape[0] for w in ws), ws[0].shape[1]),
                           cp.concatenate([w.blocks for w in ws]), cp, ws[0].fmt)
    elif all(isinstance(w, cp.ndarray) and w.ndim == 2 for w in ws) and len({(w.dtype, w.shape[1]) for w in ws}) == 1:
        joined = cp.concatenate(ws)
    else:
        return None
    bounds = [0]
    for w in ws:
        bounds.append(bounds[-1] + w.shape[0])
    return [joined[lo:hi] for lo, hi in zip(bounds[:-1], bounds[1:])]


def _or(a, b):
    return b if a is None else a


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
                key = ("static-rope", local)
                if key not in self._memo:
                    cos, sin = self.tables(local)
                    self._memo[key] = (cos[self.pos_dev], sin[self.pos_dev])
                return self._memo[key]

            def store(self, layer, k, v):
                if not self.static:
                    return super().store(layer, k, v)
                xp = self.xp
                n = k.size
                name = "kv_store_f32" if self.kv_dtype == xp.float32 else "kv_store_f16"
                _kernels(xp)[name](((n + 255) // 256,), (256,),            # both rows at pos_dev, one launch
                                   (xp.ascontiguousarray(k, dtype=xp.float32), xp.ascontiguousarray(v, dtype=xp.float32),
                                    self.k[layer], self.v[layer], self.pos_dev, xp.int32(n)))
                return (self.k[layer].astype(xp.float32, copy=False), self.v[layer].astype(xp.float32, copy=False))

            def mask(self, n_new, window=0):
                if not self.static:
                    return super().mask(n_new, window)
                key = ("static-mask", window)
                if key not in self._memo:
                    self._memo[key] = visible_mask(self.xp, self.pos_dev[:, None], self.k_pos[None, :], window)
                return self._memo[key]

            def advance(self, n_new):
                super().advance(n_new)
                if not self.static:
                    self.pos_dev[...] = self.pos
        return _DeviceCache


class MappedHost:
    """A small host array the GPU reads and writes in place (pinned, mapped: no copy call, so a captured CUDA graph
    reads the value the host wrote before each replay). .host: the NumPy view; .device: the same memory as a CuPy
    array (one address space: the host pointer is the device pointer)."""

    def __init__(self, cp, n, dtype):
        dtype = np.dtype(dtype)
        rt = cp.cuda.runtime
        self._rt, self._ptr = rt, rt.hostAlloc(n * dtype.itemsize, rt.hostAllocMapped)
        import ctypes
        self.host = np.ctypeslib.as_array((ctypes.c_byte * (n * dtype.itemsize)).from_address(self._ptr)).view(dtype)
        mem = cp.cuda.UnownedMemory(self._ptr, n * dtype.itemsize, self, device_id=cp.cuda.Device().id)
        self.device = cp.ndarray((n,), dtype=dtype, memptr=cp.cuda.MemoryPointer(mem, 0))

    def __del__(self):
        try:
            self._rt.freeHost(self._ptr)
        except Exception:        # interpreter shutdown: the driver frees it with the process
            pass


class GraphDecoder:
    """decode(token) -> logits [1, V] on the device. The first step runs eagerly (it also fills CuPy's memory
    pool with every buffer a step needs, so that capturing allocates nothing new); the second captures one
    whole decode step as a CUDA graph (with the argmax of its logits, which backend.argmax then reads instead of
    launching its own: plain greedy sampling costs no launch); later steps only write the token into mapped host
    memory and replay the graph, whose last kernel advances the device position. Nothing else allocates device
    memory between replays."""

    def __init__(self, engine, cache):
        self.engine, self.cache = engine, cache
        xp = engine.xp
        self.xp = xp
        try:          # the token the host writes and the step reads, and the steps' argmaxes, without copy calls
            self._tok, self._ring = MappedHost(xp, 1, np.int64), MappedHost(xp, RING, np.int64)
            self.tok = self._tok.device
        except Exception:                     # no mapped host memory here: a device array, filled each step
            self._tok, self._ring, self.tok = None, None, xp.zeros(1, dtype=xp.int64)
        self.graph, self.out, self.steps = None, None, 0
        self._roped = None                    # the RoPE table (cos) the captured graph reads
        self.stream = xp.cuda.Stream(non_blocking=True)
        self.use_graph = engine.backend.info.get("cuda_graphs", False)
        layers = [(_or(joined((lw.wq, lw.wk, lw.wv), xp), [lw.wq, lw.wk, lw.wv]), lw.wo,
                   joined((lw.w_gate, lw.w_up), xp), lw.w_down, lw.attn_norm, lw.ffn_norm) for lw in engine.weights.layers]
        self.fused = FusedStep.plan(engine, cache, layers)     # float16 or blocks llama weights: five kernels a layer
        self.chained = self._chained if settings().cuda_chain else None
        engine.backend.info["fused_decode"] = self.fused is not None

    def rope_holds(self, pos: int) -> bool:
        """Whether a step at host position pos reads the RoPE tables the captured graph reads: always, but where
        the sequence's length picks them (LongRoPE's factor set, dynamic NTK's base: Cache.tables), whose graph
        is captured again for a step past the length that changed them."""
        return not self.cache.cfg.rope_by_length or self.cache.tables(seq_len=pos + 1)[0] is self._roped

    def _step(self):
        """One step at the device-side position, which its last kernel advances (inside a captured graph too); the
        host position advances here (the replay path advances it itself: capture only records)."""
        c, ops = self.cache, self.engine.ops
        c.static = ops.static_decode = True
        try:
            if self.fused is not None:
                out = self.fused(self.tok)
                c.advance(1)                                # as forward's own advance for the op-by-op step
            else:
                out = self.engine.backend.forward(self.xp, self.engine.config, self.engine.weights, self.tok, c, ops)
        finally:
            c.static = ops.static_decode = False
        _kernels(self.xp)["bump_pos"]((1,), (1,), (c.pos_dev,))
        return out

    def __call__(self, token):
        xp, c = self.xp, self.cache
        c.check_room(1)
        with self.stream:
            if self._tok is not None:
                self._tok.host[0] = int(token)  # the previous step is over (synchronized below)
            else:
                self.tok[...] = int(token)
            self.steps += 1
            if not self.use_graph or self.steps == 1:
                out = self._step()
            else:
                if self.graph is not None and not self.rope_holds(c.pos):
                    self.graph = None        # the captured step reads other RoPE tables than this step's
                if self.graph is None:
                    p0 = c.pos
                    self._roped = c.tables()[0]     # built here, not inside the capture
                    try:
                        rt = xp.cuda.runtime
                        mode = getattr(rt, "streamCaptureModeRelaxed", None)
                        self.stream.begin_capture(*(() if mode is None else (mode,)))
                        self.out = self._step()
                        if self._ring is not None:  # the argmax greedy sampling asks for, in the same graph:
                            _kernels(xp)["argmax_feed"]((1,), (1024,), (self.out, np.int32(self.out.size),  # the
                                                        self.tok, self._ring.device, np.int32(RING), c.pos_dev))  # next
                            # step's input (chained reads it) and ring slot pos % RING
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
                if self._ring is not None:
                    self.engine.backend.step_argmax[out.data.ptr] = (out, self._ring, c.pos % RING)
        self.stream.synchronize()
        return out

    def _chained(self, first):
        """Plain greedy decoding from token `first` -> yields each next token, the steps chained on the device: a
        replayed step's argmax is the next step's input (argmax_feed), so one step is launched ahead of the token
        the host reads (the card never waits for the host between steps). The tokens are the unchained steps' (the
        same graph). cache.pos counts the steps whose token was read; closing the generator waits for the step
        ahead and sets the device position back to it (its K/V row past the sequence is never read).
        Before the graph is captured, without a graph or mapped memory, and for a step whose RoPE tables are not the
        graph's (rope_holds): the steps one at a time through __call__ (which captures the step again). Generation
        takes it as `chained` (None with settings' cuda_chain off: one step at a time)."""
        tok, c, s = int(first), self.cache, self.stream
        while True:
            while self.graph is None or not self.use_graph or self._ring is None or not self.rope_holds(c.pos):
                tok = self.engine.backend.argmax(self(tok)[-1])     # eager, captured, or captured again
                yield tok
            ahead = []                                              # (event, ring slot) of steps launched, unread
            self._tok.host[0] = tok
            try:
                while True:
                    while len(ahead) < 2 and c.pos + len(ahead) < c.n_ctx and self.rope_holds(c.pos + len(ahead)):
                        with s:
                            self.graph.launch(s)
                            done = self.xp.cuda.Event(disable_timing=True)
                            done.record(s)
                        ahead.append((done, (c.pos + len(ahead) + 1) % RING))
                    if not ahead:
                        c.check_room(1)                             # the context is full: its one-line error
                        break                                       # the next step reads other RoPE tables
                    done, slot = ahead.pop(0)
                    done.synchronize()
                    c.pos += 1
                    self.steps += 1
                    tok = int(self._ring.host[slot])
                    yield tok
            finally:
                s.synchronize()
                with s:
                    c.pos_dev[...] = c.pos                          # the step launched ahead, undone
                s.synchronize()


RING = 4            # ring slots of the steps' argmaxes (chained keeps at most two steps unread)
