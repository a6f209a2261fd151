"""llama.cpp through llama-cpp-python 0.3.36's low-level API, with intermediate tensors captured
by the eval callback (`llama_context_params.cb_eval`).

Settings that keep tensors visible and exact are forced: flash attention off (else kq/kq_soft_max/kqv
do not exist), K/V cache type as asked (F32 for exact work), logits for every token (a batch from
llama_batch_init), no weight repacking (use_extra_bufts=False). A batch longer than n_ubatch runs as
micro-batches, one graph each (Capture.graphs).
Tensor names are not unique in the llama graph, so captures are keyed by (name, op, occurrence).
"""
from __future__ import annotations

import ctypes
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..dtypes import SHORT, dtype_name
from ..errors import ParameterError, PromptError, ReferenceError_
from ..numerics.ggml_build import installed_build_features

EXPECTED_VERSION = "0.3.36"
GGML_TYPE_F32, GGML_TYPE_F16 = 0, 1
KV_TYPES = {"float32": GGML_TYPE_F32, "float16": GGML_TYPE_F16}


class GGMLTensorPrefix(ctypes.Structure):
    """The leading fields of ggml.h's `struct ggml_tensor` (GGML_MAX_DIMS=4, GGML_MAX_SRC=10,
    GGML_MAX_OP_PARAMS=64 bytes, GGML_MAX_NAME=64). Checked at run time against ggml's own accessors."""
    _fields_ = [
        ("type", ctypes.c_int32),
        ("buffer", ctypes.c_void_p),
        ("ne", ctypes.c_int64 * 4),
        ("nb", ctypes.c_size_t * 4),
        ("op", ctypes.c_int32),
        ("op_params", ctypes.c_int32 * 16),
        ("flags", ctypes.c_int32),
        ("src", ctypes.c_void_p * 10),
        ("view_src", ctypes.c_void_p),
        ("view_offs", ctypes.c_size_t),
        ("data", ctypes.c_void_p),
        ("name", ctypes.c_char * 64),
    ]


def _import():
    try:
        import llama_cpp
        import llama_cpp._ggml as _ggml
    except ImportError as e:
        raise ReferenceError_(f"llama-cpp-python is not installed ({e}); install llorch-ref[llamacpp]") from None
    if llama_cpp.__version__ != EXPECTED_VERSION:
        raise ReferenceError_(f"llama-cpp-python {llama_cpp.__version__} found, but the capture is written "
                              f"for {EXPECTED_VERSION}: its ggml_tensor layout may differ")
    return llama_cpp, _ggml.libggml


_GGML = None


def check_gpu_layers(n_gpu_layers) -> int:
    """n_gpu_layers as llama.cpp takes it (0: every layer on the CPU, as the CPU wheel runs; n > 0: the first n
    layers, 99 all, on the GPU); more than 0 refused where the installed llama-cpp-python has no GPU backend
    (llama_supports_gpu_offload()), since a CPU build would run those layers on the CPU without a word."""
    n = int(n_gpu_layers or 0)
    if n < 0:
        raise ParameterError(f"--gpu-layers {n}: 0 or more (99: every layer)")
    if n:
        llama_cpp, _ = _import()
        if not llama_cpp.llama_supports_gpu_offload():
            raise ParameterError(f"--gpu-layers {n}: the installed llama-cpp-python has no GPU backend "
                                 f"(llama_supports_gpu_offload() is false): rebuild it with CUDA "
                                 f"(docs/engines-under-test.md), or leave --gpu-layers out")
    return n


def build_features() -> list[str]:
    """The CPU features llama.cpp's build uses (numerics.ggml_build.installed_build_features; an error when
    llama-cpp-python is missing)."""
    _import()
    return installed_build_features()


def _ggml_funcs():
    global _GGML
    if _GGML is None:
        _, lib = _import()
        f = {}
        for name, res, args in [
            ("ggml_get_name", ctypes.c_char_p, [ctypes.c_void_p]),
            ("ggml_op_desc", ctypes.c_char_p, [ctypes.c_void_p]),
            ("ggml_nbytes", ctypes.c_size_t, [ctypes.c_void_p]),
            ("ggml_n_dims", ctypes.c_int, [ctypes.c_void_p]),
            ("ggml_type_size", ctypes.c_size_t, [ctypes.c_int]),
            ("ggml_blck_size", ctypes.c_int64, [ctypes.c_int]),
            ("ggml_backend_tensor_get", None, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]),
        ]:
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = res, args
            f[name] = fn
        _GGML = f
    return _GGML


@dataclass
class Capture:
    """Which graph nodes to copy out: a set of exact node names (e.g. {"Qcur-0", "kq-3"}) or None for all.

    llama.cpp computes a batch longer than n_ubatch as several graphs, one per micro-batch, in order: each
    graph's nodes land in `graphs[g]` (a new graph starts after the node `result_output`, the last of every
    graph). keep(graph, name, arr) -> the array to hold (a part of it, or None for nothing), called as each
    node is read, so that a long prompt's large nodes never pile up in memory. rows(graph, name) -> None
    (read the whole node) or (axis, indices): read only those indices along that axis of the node as read
    (NumPy order, ggml's trailing size-1 dims dropped); no indices: nothing is read, nothing kept. A long
    prompt's sampled rows are so the only ones ever copied out of llama.cpp."""
    names: set | None = None
    keep: object = None
    rows: object = None
    graphs: list = field(default_factory=lambda: [{}])   # per graph: (name, op, occurrence) -> np.ndarray
    nodes: list = field(default_factory=list)     # (name, op, ggml ne) of every captured node, in order
    _seen: dict = field(default_factory=dict)
    checked: bool = False

    @property
    def tensors(self) -> dict:
        """The first (for a batch within n_ubatch: the only) graph's nodes."""
        return self.graphs[0]

    def wants(self, name: str) -> bool:
        return self.names is None or name in self.names

    def rows_of(self, name: str):
        """What rows(graph, name) asks read of this node of the graph being computed (None: all of it)."""
        return None if self.rows is None else self.rows(len(self.graphs) - 1, name)

    def add(self, name, op, ne, arr):
        occ = self._seen.get((name, op), 0)
        self._seen[(name, op)] = occ + 1
        self.nodes.append((name, op, ne))
        if arr is not None and self.keep is not None:
            arr = self.keep(len(self.graphs) - 1, name, arr)
        if arr is not None:
            self.graphs[-1][(name, op, occ)] = arr
        if name == "result_output":                 # the graph's last node: the next node starts another
            self.graphs.append({})
            self._seen = {}

    def open_graph(self):
        """Before a batch after another: its first node starts a graph of its own."""
        if self.graphs[-1]:
            self.graphs.append({})
            self._seen = {}

    def done(self):
        """After the batch: drop the empty graph opened by the last result_output."""
        if len(self.graphs) > 1 and not self.graphs[-1]:
            self.graphs.pop()


def _read_tensor(ptr, rows_of=None) -> tuple[str, str, tuple, np.ndarray | None]:
    """A graph node -> (name, op, ggml ne, float32 array in NumPy order, ggml's trailing size-1 dims dropped;
    None for other types). rows_of(name) -> None or (axis, indices): only those indices along that axis are
    copied out (none: nothing is read)."""
    g = _ggml_funcs()
    t = GGMLTensorPrefix.from_address(ptr)
    name = g["ggml_get_name"](ptr).decode()
    op = g["ggml_op_desc"](ptr).decode()
    ne = tuple(int(n) for n in t.ne)
    if t.type not in (GGML_TYPE_F32, GGML_TYPE_F16):
        return name, op, ne, None
    nbytes = g["ggml_nbytes"](ptr)
    esize = g["ggml_type_size"](t.type)
    # layout check: the struct must agree with ggml's own accessors, or we would read garbage
    if t.name.decode(errors="replace") != name:
        raise ReferenceError_(f"ggml_tensor layout mismatch: struct name {t.name!r} != ggml_get_name {name!r}")
    span = esize + sum((n - 1) * s for n, s in zip(ne, t.nb))
    if span != nbytes:
        raise ReferenceError_(f"ggml_tensor layout mismatch for {name}: ne/nb span {span} != ggml_nbytes {nbytes}")
    sel = None if rows_of is None else rows_of(name)
    if sel is not None:
        nd = max(int(g["ggml_n_dims"](ptr)), 1)
        axis, idx = sel
        if not len(idx):
            return name, op, ne, None
        if not 0 <= axis < nd or min(idx) < 0 or max(idx) >= ne[nd - 1 - axis]:
            raise ReferenceError_(f"{name}: indices {min(idx)}..{max(idx)} of axis {axis} asked of a node of "
                                  f"sizes {tuple(reversed(ne[:nd]))}")
        return name, op, ne, _read_indices(g, ptr, t, ne, nd - 1 - axis, idx).reshape(
            _kept_shape(ne, nd, nd - 1 - axis, len(idx)))
    buf = np.empty(nbytes, dtype=np.uint8)
    g["ggml_backend_tensor_get"](ptr, buf.ctypes.data, 0, nbytes)
    dt = np.float32 if t.type == GGML_TYPE_F32 else np.float16
    shape = tuple(reversed(ne))
    strides = tuple(reversed([int(s) for s in t.nb]))
    arr = np.lib.stride_tricks.as_strided(buf.view(dt), shape=shape, strides=strides).astype(np.float32)
    nd = max(int(g["ggml_n_dims"](ptr)), 1)
    return name, op, ne, arr.reshape(arr.shape[4 - nd:])     # drop ggml's trailing size-1 dims


def _kept_shape(ne, nd: int, d: int, n: int) -> tuple:
    """The NumPy shape of a node of ggml sizes ne (nd dims) with n indices of ggml dim d kept."""
    kept = list(ne[:nd])
    kept[d] = n
    return tuple(reversed(kept))


def _read_indices(g, ptr, t, ne, d: int, idx) -> np.ndarray:
    """The node's entries at the indices idx of ggml dim d (every index of the other dims) -> float32 [dims
    above d (outermost first), len(idx), dims below d], one ggml_backend_tensor_get per index and outer index:
    the bytes of the indices not asked are never copied."""
    import itertools

    esize = int(g["ggml_type_size"](t.type))
    nb = [int(x) for x in t.nb]
    dt = np.float32 if t.type == GGML_TYPE_F32 else np.float16
    span = esize + sum((ne[i] - 1) * nb[i] for i in range(d))         # the bytes of one index of dim d
    low_shape, low_strides = tuple(reversed(ne[:d])), tuple(reversed(nb[:d]))
    outer = list(itertools.product(*[range(ne[i]) for i in range(3, d, -1)]))
    out = np.empty(tuple(ne[i] for i in range(3, d, -1)) + (len(idx),) + low_shape, dtype=np.float32)
    buf = np.empty(span + (-span) % 4, dtype=np.uint8)
    for hi in outer:
        base = sum(i * nb[j] for i, j in zip(hi, range(3, d, -1)))
        for k, r in enumerate(idx):
            g["ggml_backend_tensor_get"](ptr, buf.ctypes.data, base + int(r) * nb[d], span)
            out[hi + (k,)] = np.lib.stride_tricks.as_strided(buf.view(dt), shape=low_shape, strides=low_strides)
    return out


class LlamaCpp:
    """One llama.cpp model + context. eval(tokens) runs a fresh sequence and returns logits [T, V]."""

    def __init__(self, path, n_ctx=512, kv_dtype="float32", n_threads=2, n_ubatch=512, seed=0, flash_attn=False,
                 n_batch=None, n_seq=1, n_gpu_layers=0):
        """n_batch: the most tokens one eval takes (default n_ubatch); llama.cpp computes a batch longer than
        n_ubatch as micro-batches of n_ubatch tokens, one graph each. n_seq: the sequences one batch may hold
        (decode_rows); more than one share one unified K/V cache of n_ctx cells, filled in batch order.
        n_gpu_layers: the layers llama.cpp runs on its GPU backend, their K/V cache and attention there too
        (check_gpu_layers; 0: all on the CPU)."""
        n_gpu_layers = check_gpu_layers(n_gpu_layers)
        llama_cpp, _ = _import()
        self.llama_cpp = llama_cpp
        kv_dtype = dtype_name(kv_dtype, tuple(KV_TYPES), "kv_dtype")
        # ggml's tiled K-quant matmul (used for batches of >= 8 rows) has its own summation order, which
        # numerics="ggml" does not reproduce; the stock vec_dot path is kept unless the caller set this
        # variable. It is read once per process, before the first matrix product.
        os.environ.setdefault("GGML_CPU_TILED_MM", "0")
        if Path(path).is_dir():
            raise ReferenceError_(f"{path}: llama.cpp reads GGUF files, not folders; pass --reference-model "
                                  f"FILE.gguf (e.g. the GGUF the folder was converted from, or its F32 copy)")
        llama_cpp.llama_backend_init()
        self._quiet()
        mp = llama_cpp.llama_model_default_params()
        mp.use_extra_bufts = False
        mp.n_gpu_layers = n_gpu_layers
        self.model = llama_cpp.llama_model_load_from_file(str(path).encode(), mp)
        if not self.model:
            raise ReferenceError_(f"{path}: llama.cpp could not load the model")
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self.vocab)
        cp = llama_cpp.llama_context_default_params()
        cp.n_ctx = n_ctx
        n_batch = max(int(n_batch or n_ubatch), n_ubatch)
        cp.n_batch = n_batch
        cp.n_ubatch = n_ubatch
        cp.n_threads = cp.n_threads_batch = n_threads
        cp.flash_attn_type = (llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn
                              else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED)
        cp.type_k = cp.type_v = KV_TYPES[kv_dtype]
        cp.n_seq_max = int(n_seq)
        cp.kv_unified = int(n_seq) > 1
        cp.offload_kqv = n_gpu_layers > 0
        self._capture: Capture | None = None
        self._cb = llama_cpp.ggml_backend_sched_eval_callback(self._eval_cb)   # kept alive on self
        cp.cb_eval = self._cb
        cp.cb_eval_user_data = None
        self.ctx = llama_cpp.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise ReferenceError_("llama.cpp could not create a context")
        self.settings = {"n_ctx": n_ctx, "n_batch": n_batch, "n_ubatch": n_ubatch, "n_threads": n_threads,
                         "flash_attn": bool(flash_attn), "type_k": SHORT[kv_dtype], "type_v": SHORT[kv_dtype], "use_extra_bufts": False,
                         "logits": "all tokens (llama_batch_init)", "llama_cpp_python": llama_cpp.__version__,
                         "GGML_CPU_TILED_MM": os.environ.get("GGML_CPU_TILED_MM"), "build": build_features()}
        if n_seq > 1:
            self.settings.update(n_seq_max=int(n_seq), kv_unified=True)
        if n_gpu_layers:
            self.settings.update(n_gpu_layers=n_gpu_layers, offload_kqv=True)
        self.n_ctx, self.n_ubatch, self.n_batch, self.path = n_ctx, n_ubatch, n_batch, str(path)

    @staticmethod
    def _quiet():
        import llama_cpp

        @llama_cpp.llama_log_callback
        def _log(level, text, user_data):
            pass
        LlamaCpp._log_cb = _log          # keep alive
        llama_cpp.llama_log_set(_log, ctypes.c_void_p(0))

    def _eval_cb(self, t, ask, user_data):
        cap = self._capture
        if cap is None:
            return False if ask else True
        try:
            if ask:
                name = _ggml_funcs()["ggml_get_name"](t).decode()
                return cap.wants(name)
            cap.add(*_read_tensor(t, cap.rows_of if cap.rows is not None else None))
            cap.checked = True
        except Exception as e:  # never let an exception cross the C boundary
            cap.error = e
        return True

    def eval(self, tokens, capture: Capture | None = None, sink=None) -> np.ndarray | None:
        """tokens: [T] -> logits [T, V] float32 of a fresh sequence (KV memory cleared first). More than n_batch
        tokens are fed as consecutive batches of n_batch (llama.cpp's own prompt loop), each computed as
        micro-batches of n_ubatch; a capture sees one graph per micro-batch either way. sink(first row,
        logits [n, V]): each batch's logits handed over as it is computed (then None is returned: a long
        prompt's [T, V] never held whole)."""
        lc = self.llama_cpp
        tokens = [int(t) for t in tokens]
        if not tokens:
            raise PromptError("empty token list")
        if len(tokens) > self.n_ctx:
            raise PromptError(f"{len(tokens)} tokens exceed llama.cpp's n_ctx ({self.n_ctx})")
        lc.llama_memory_clear(lc.llama_get_memory(self.ctx), True)
        parts = []
        for a in range(0, len(tokens), self.n_batch):
            if sink is not None:            # a batch's logits read out a span of rows at a time
                self._decode(tokens[a:a + self.n_batch], a, capture, all_logits=True,
                             sink=lambda j, out, a=a: sink(a + j, out))
            else:
                parts.append(self._decode(tokens[a:a + self.n_batch], a, capture, all_logits=True))
        if sink is not None:
            return None
        return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)

    def eval_at(self, tokens, pos: int, capture: Capture | None = None) -> np.ndarray:
        """tokens: [T] appended at positions pos.. of the sequence held (no clearing: a decode step after
        eval) -> their logits [T, V]."""
        tokens = [int(t) for t in tokens]
        if pos + len(tokens) > self.n_ctx:
            raise PromptError(f"positions {pos}..{pos + len(tokens) - 1} exceed llama.cpp's n_ctx {self.n_ctx}")
        return self._decode(tokens, pos, capture, all_logits=True)

    SINK_ROWS = 256       # rows of logits read out of llama.cpp's buffer at once where they go to a sink

    def _decode(self, tokens, pos0, capture, all_logits, sink=None):
        """One llama_decode -> the logits of its rows (all, or the last) [n, V]; with sink(first row, [m, V]) they
        are handed over SINK_ROWS rows at a time instead (None returned)."""
        lc = self.llama_cpp
        n = len(tokens)
        batch = lc.llama_batch_init(n, 0, 1)
        try:
            for i, tok in enumerate(tokens):
                batch.token[i] = tok
                batch.pos[i] = pos0 + i
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = 0
                batch.logits[i] = 1 if (all_logits or i == n - 1) else 0
            batch.n_tokens = n
            self._capture = capture
            if capture is not None:
                capture.error = None
                capture.open_graph()
            rc = lc.llama_decode(self.ctx, batch)
            self._capture = None
            if capture is not None:
                capture.done()
            if capture is not None and capture.error is not None:
                raise ReferenceError_(f"llama.cpp capture failed: {capture.error}")
            if rc != 0:
                raise ReferenceError_(f"llama_decode returned {rc}")
            rows = list(range(n)) if all_logits else [n - 1]
            step = len(rows) if sink is None else self.SINK_ROWS
            for j0 in range(0, len(rows), step):
                part = rows[j0:j0 + step]
                out = np.empty((len(part), self.n_vocab), dtype=np.float32)
                for j, i in enumerate(part):
                    p = lc.llama_get_logits_ith(self.ctx, i)
                    out[j] = np.ctypeslib.as_array(p, shape=(self.n_vocab,))
                if sink is None:
                    return out
                sink(j0, out)
            return None
        finally:
            lc.llama_batch_free(batch)

    def clear(self):
        """Every sequence's K/V memory cleared (the next batch starts at cell 0)."""
        self.llama_cpp.llama_memory_clear(self.llama_cpp.llama_get_memory(self.ctx), True)

    def decode_rows(self, rows, capture: Capture | None = None, outputs=None) -> np.ndarray:
        """One llama_batch of rows (token, position, sequence id), in that order: several sequences in one
        batch, each attending to its own positions only. outputs: the rows whose logits are computed (default
        every row) -> their logits [len(outputs), V]."""
        lc = self.llama_cpp
        n = len(rows)
        if n == 0 or n > self.n_batch:
            raise PromptError(f"{n} rows in one batch: 1 to n_batch ({self.n_batch})")
        want = set(range(n)) if outputs is None else set(outputs)
        batch = lc.llama_batch_init(n, 0, 1)
        try:
            for i, (tok, pos, seq) in enumerate(rows):
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = int(tok), int(pos), 1
                batch.seq_id[i][0] = int(seq)
                batch.logits[i] = 1 if i in want else 0
            batch.n_tokens = n
            self._capture = capture
            if capture is not None:
                capture.error = None
            rc = lc.llama_decode(self.ctx, batch)
            self._capture = None
            if capture is not None:
                capture.done()
                if capture.error is not None:
                    raise ReferenceError_(f"llama.cpp capture failed: {capture.error}")
            if rc != 0:
                raise ReferenceError_(f"llama_decode returned {rc}")
            return np.stack([np.ctypeslib.as_array(lc.llama_get_logits_ith(self.ctx, i), shape=(self.n_vocab,))
                             for i in sorted(want)]).astype(np.float32)
        finally:
            lc.llama_batch_free(batch)

    def eval_last(self, tokens) -> np.ndarray:
        """tokens: [T] -> logits [V] of the last position only (llama.cpp then computes one output row)."""
        return self._prefill_last([int(t) for t in tokens])[-1]

    def _prefill_last(self, tokens) -> np.ndarray:
        """A fresh sequence fed in batches of n_batch, the last token's logits only -> [1, V]."""
        lc = self.llama_cpp
        lc.llama_memory_clear(lc.llama_get_memory(self.ctx), True)
        for a in range(0, len(tokens), self.n_batch):
            out = self._decode(tokens[a:a + self.n_batch], a, None, all_logits=False)
        return out

    def greedy(self, tokens, max_tokens: int, stop_ids=(), timing=None, prompt_logits=None) -> list[int]:
        """Greedy continuation (argmax of llama.cpp's logits = its temperature-0 sampler), token by token.

        timing: a dict; gets "decode_s", the time from the end of the prompt's forward to the last token
        (as GenerationResult.decode_s measures llorch-ref's). prompt_logits: a list; gets the prompt's last-row
        logits [V] (eval_last's, from the same prefill)."""
        tokens = [int(t) for t in tokens]
        logits = self._prefill_last(tokens)
        if prompt_logits is not None:
            prompt_logits.append(np.array(logits[-1], copy=True))
        t0 = time.perf_counter()
        out, pos = [], len(tokens)
        for _ in range(max_tokens):
            nxt = int(np.argmax(logits[-1]))
            if nxt in stop_ids:
                break
            out.append(nxt)
            if pos + 1 > self.n_ctx:
                break
            logits = self._decode([nxt], pos, None, all_logits=False)
            pos += 1
        if timing is not None:
            timing["decode_s"] = time.perf_counter() - t0
        return out

    def close(self):
        lc = self.llama_cpp
        if getattr(self, "ctx", None):
            lc.llama_free(self.ctx)
            self.ctx = None
        if getattr(self, "model", None):
            lc.llama_model_free(self.model)
            self.model = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def tokenize(path, text: str) -> list[int]:
    """llama_tokenize(text, add_special=True, parse_special=True) on the file's vocabulary."""
    llama_cpp, _ = _import()
    llm = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    return llm.tokenize(text.encode("utf-8"), add_bos=True, special=True)
