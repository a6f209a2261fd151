"""The independent references as dump writers: llama.cpp (eval-callback capture) and transformers (forward
hooks). Each returns a llorch_ref.dump.Recorder, so a reference is just another engine's dump."""
from __future__ import annotations

import contextlib
import importlib
import types
from collections import Counter
from pathlib import Path

import numpy as np

from ..checkpoints import load_specs
from ..convert import convert_gguf_to_hf
from ..dtypes import KV_DTYPES, SHORT, dtype_name
from ..dump import (
    SCORE_TENSORS,
    Recorder,
    capture_invariance,
    catalogue,
    check_rows,
    invariance_figure,
    max_abs_diff,
    select_rows,
    token_axis,
)
from ..errors import ParameterError, PromptError, ReferenceError_
from ..loaders.default_model import home, sha256_file
from ..loaders.gguf_file import config_from_metadata, open_reader, read_metadata, rope_freqs_of
from ..numerics.ggml_build import simd_of
from ..tensor_file import SpillStore
from .llamacpp import Capture, LlamaCpp, check_gpu_layers, tokenize


def gguf_config(path):
    """Config of a GGUF file without loading its weights."""

    r = open_reader(path)
    shapes = {t.name: tuple(int(x) for x in reversed([int(s) for s in t.shape])) for t in r.tensors}
    return config_from_metadata(read_metadata(r), Path(path), shapes, rope_freqs_of({t.name: t for t in r.tensors}))


# with flash attention, llama.cpp computes Q.K^T, the softmax and P.V in one fused op: no node holds them
FUSED_BY_FLASH_ATTN = {"kq", "kq_soft_max", "kqv_out"}


def check_token_ids(token_ids, n_vocab: int, n_ctx: int) -> list[int]:
    """-> the ids as ints; PromptError (one line) for an empty list, an id outside the vocabulary, or more
    ids than the model's context, before any engine runs them."""
    ids = [int(t) for t in token_ids]
    if not ids:
        raise PromptError("no token ids: at least one is needed")
    bad = [t for t in ids if not 0 <= t < n_vocab]
    if bad:
        raise PromptError(f"token id {bad[0]} is outside the vocabulary (0..{n_vocab - 1})")
    if len(ids) > n_ctx:
        raise PromptError(f"{len(ids)} token ids but the model's context holds {n_ctx}")
    return ids


def dump_llamacpp(path, prompt=None, token_ids=None, n_greedy=32, kv_dtype="float32", array_order="ggml",
                  checkpoints=None, flash_attn=False, n_ubatch=512, n_threads=2, context=None, decode_steps=0,
                  decode_ids=None, rows=None, store=None, score_rows=None, n_batch=None, n_gpu_layers=0) -> Recorder:
    """llama.cpp on a GGUF file -> Recorder. Tensors are written as ggml holds them (array_order "ggml":
    shapes listed as ne[], innermost first), K/V views cut to the positions written, kq to its columns.
    Decode steps after the prompt (each one token, every layer tensor and the logits captured): the tokens
    decode_ids when given (teacher forcing), else decode_steps greedy tokens of llama.cpp's own.
    A prompt longer than n_ubatch runs as llama.cpp's micro-batches (one graph each), put together.
    rows: the prompt's rows to keep (indices into the ids; default all), to bound a long prompt's memory;
    score_rows: the rows among them whose attention scores are kept (default: those rows); store: where the
    tensors go (a tensor_file.SpillStore: to disk, each node as it is read). A prompt longer than 2,048 tokens
    is fed in batches of n_batch tokens (default 2,048, llama.cpp's), each as micro-batches of n_ubatch: the same
    graphs at any n_batch, which sets the rows of logits llama.cpp's output buffer holds.
    context: an open LlamaCpp on the same file to reuse (its settings must be those asked for); it is left
    open. Else one is made for this dump and closed. n_gpu_layers: the layers llama.cpp runs on its GPU backend
    (refused without one); such a dump declares no arithmetic llorch-ref reproduces (reproducible false: the
    ggml numerics emulate the CPU build), so a comparison judges it by the end-to-end bands."""
    kv_dtype = dtype_name(kv_dtype, KV_DTYPES, "kv_dtype")
    n_gpu_layers = check_gpu_layers(n_gpu_layers)
    path = Path(path)
    if path.is_dir():
        raise ParameterError(f"{path}: llama.cpp reads GGUF files, not folders: pass a GGUF file (to diff a "
                             f"folder: --reference-model FILE.gguf, e.g. the GGUF it was converted from; or make one "
                             f"with llorch-ref convert)")
    if n_ubatch < 1 or n_threads < 1:
        raise ParameterError(f"n_ubatch ({n_ubatch}) and n_threads ({n_threads}) must be >= 1")
    if n_batch is not None and n_batch < n_ubatch:
        raise ParameterError(f"n_batch ({n_batch}) must be >= n_ubatch ({n_ubatch}): a batch runs as micro-batches")
    cfg = gguf_config(path)
    if token_ids is None:
        if prompt is None:
            raise ParameterError("give a prompt or token ids")
        token_ids = tokenize(path, prompt)
    steps = len(decode_ids) if decode_ids is not None else int(decode_steps)
    ids = check_token_ids(token_ids, cfg.n_vocab, cfg.context_length - steps)
    t, specs = len(ids), load_specs(checkpoints)
    rows = check_rows(rows, t)
    rec = Recorder("llama.cpp", f"{llama_cpp_version()} (llama-cpp-python)", model_path=path, token_ids=ids,
                   prompt=prompt, layouts={"array_order": array_order, "rope_pairs": cfg.rope_style},
                   notes=f"K/V cache {kv_dtype}, flash attention {'on' if flash_attn else 'off'}, n_ubatch {n_ubatch}, "
                         f"{n_threads} threads" + (f", {n_gpu_layers} layers on the GPU" if n_gpu_layers else ""),
                   rows=rows, store=store, score_rows=score_rows)
    need = t + max(n_greedy, steps)
    if context is not None:
        _check_context(context, path, n_ctx=need, type_k=SHORT[kv_dtype], flash_attn=flash_attn, n_ubatch=n_ubatch,
                       n_gpu_layers=n_gpu_layers or None)
    ref = context or LlamaCpp(path, n_ctx=max(256, 64 * ((need + 63) // 64)), kv_dtype=kv_dtype,
                              flash_attn=flash_attn, n_ubatch=n_ubatch, n_batch=min(t, n_batch or max(DEFAULT_N_BATCH, n_ubatch)),
                              n_threads=n_threads, n_gpu_layers=n_gpu_layers)
    rec.extra["arithmetic"] = {"numerics": "ggml", "ggml_simd": simd_of(ref.settings.get("build", ())),
                               "kv_dtype": kv_dtype,
                               "settings": dict(ref.settings)}     # numerics ggml reproduces this build's sums
    if n_gpu_layers:        # the GPU backend's kernels: no arithmetic here reproduces them, op by op
        rec.extra["arithmetic"] = {"numerics": "exact", "kv_dtype": kv_dtype, "reproducible": False,
                                   "settings": dict(ref.settings)}
    capture = _LlamaCppCapture(rec, specs, cfg, flash_attn, array_order, rows=rows, score_rows=score_rows)
    try:
        if prompt is not None and any(s.id == "0" for s in specs):
            rec.add("cp0.token_ids", np.array(tokenize(path, prompt), dtype=np.int64))
        ids_of = {s.id for s in specs}
        wanted = "8" in ids_of or "10" in ids_of or "11" in ids_of
        logits = capture.run(ref, ids, pos=0, logits_to="cp8.logits" if wanted else None)   # the rows kept only
        last = np.array(logits[-1], copy=True)
        if steps:
            capture.decode(ref, t, last, steps, decode_ids)
        rec.extra["capture_invariance"] = _invariance(ref, ids, rows, logits)
        if wanted and not isinstance(logits, StoredRows):
            capture.put("cp8.logits", logits)
        del logits
        if "12" in ids_of and n_greedy > 0:            # cp9 from the greedy run's own prefill (eval_last's)
            last_row = []
            greedy = ref.greedy(ids, n_greedy, prompt_logits=last_row)
            if "9" in ids_of:
                capture.put("cp9.logits", last_row[0])
            rec.add("cp12.greedy_tokens", np.array(greedy, dtype=np.int64))
        elif "9" in ids_of:
            capture.put("cp9.logits", ref.eval_last(ids))
    finally:
        if context is None:
            ref.close()
    return rec


DEFAULT_N_BATCH = 2048         # llama.cpp's default n_batch: the most tokens one llama_decode takes


def _invariance(ref, ids, rows, kept) -> dict:
    """capture_invariance of the captured forward's kept rows (an array, or StoredRows on disk) against an
    uncaptured forward's, batch by batch (a long prompt's [T, V] logits never twice in memory)."""
    worst = [0.0]
    where = {r: i for i, r in enumerate(rows)} if rows is not None else None

    def sink(a, out):
        n = len(out)
        if where is None:
            worst[0] = max(worst[0], max_abs_diff(out, kept[a:a + n]))
            return
        mine = [r for r in range(a, a + n) if r in where]
        if mine:          # the kept rows of a batch follow each other among the rows kept
            worst[0] = max(worst[0], max_abs_diff(out[[r - a for r in mine]], kept[where[mine[0]]:where[mine[-1]] + 1]))
    ref.eval(ids, sink=sink)
    return invariance_figure(worst[0])


class StoredRows:
    """A [R, V] tensor in a SpillStore, read a span of rows at a time: rows[a:b] (a step of 1), rows[-1]."""

    def __init__(self, store, name: str, n: int):
        self.store, self.name, self.n = store, name, n

    def __len__(self):
        return self.n

    def __getitem__(self, key):
        if isinstance(key, int):
            i = key % self.n
            return self.store.read_rows(self.name, i, i + 1, self.n)[0]
        a, b, step = key.indices(self.n)
        if step != 1:
            raise IndexError("StoredRows reads spans of rows (a step of 1)")
        return self.store.read_rows(self.name, a, b, self.n)


class _LlamaCppCapture:
    """The checkpoint tensors of llama.cpp forwards, captured through its eval callback and written to a
    Recorder in the declared array order: the prompt's forward (step 0) and decode steps after it. A prompt
    longer than n_ubatch runs as micro-batches (one graph each): their rows are put together into the
    prompt's tensors, the caches taken after the last. With rows, only those rows of the prompt are kept,
    as each node is read."""

    def __init__(self, rec: Recorder, specs, cfg, flash_attn: bool, array_order: str, rows=None, score_rows=None):
        self.rec, self.specs, self.cfg, self.flash_attn, self.array_order = rec, specs, cfg, flash_attn, array_order
        self.rows, self.score_rows = rows, score_rows
        self.score_names = set()               # the nodes of kq/kq_soft_max (kept at score_rows where given)
        self.spill = SpillStore(prefix="llorch-capture-") if isinstance(rec.tensors, SpillStore) else None
        self.names = {"result_output"}
        self.axis = {"result_output": 0}      # node name -> its rows' axis as read (NumPy order), None: a cache
        cat = catalogue()
        for s in specs:
            for ts in s.tensors_for(cfg):
                if ts.node(cfg) is None:
                    continue
                ax = token_axis(cat[(s.id, ts.ours)])
                raw = None if ax is None else (1 if cat[(s.id, ts.ours)]["shape"].startswith("H,T") else 0)
                for i in range(cfg.n_layers):
                    name = ts.node(cfg)["name"].replace("{L}", str(i))
                    self.names.add(name)
                    if ts.ours in SCORE_TENSORS:
                        self.score_names.add(name)
                    self.axis[name] = raw if self.axis.get(name, raw) == raw else "whole"

    def put(self, name, a, step: int = 0):
        a = np.ascontiguousarray(a, dtype=np.float32)
        self.rec.add(name, a.reshape(a.shape[::-1]) if self.array_order == "ggml" else a, step=step)

    def canonical(self, t: int, s: int) -> dict:
        """our name -> fn(llama.cpp array in NumPy order) -> canonical array, for t rows of new tokens (s cache
        positions after them)."""
        hd, kv, h = self.cfg.head_dim, self.cfg.n_kv_heads, self.cfg.n_heads
        k_cache = lambda a: a.reshape(-1, kv, hd)[:s]
        return {
            "q_proj": lambda a: a.reshape(t, h, hd), "k_proj": lambda a: a.reshape(t, kv, hd),
            "v": lambda a: a.reshape(t, kv, hd), "q": lambda a: a.reshape(t, h, hd),
            "k": lambda a: a.reshape(t, kv, hd), "q_normed": lambda a: a.reshape(t, h, hd),
            "k_normed": lambda a: a.reshape(t, kv, hd), "k_cache": k_cache,
            # llama.cpp stores V transposed only without flash attention
            "v_cache": k_cache if self.flash_attn else lambda a: a.reshape(hd, kv, -1).transpose(2, 1, 0)[:s],
            "kq": lambda a: a.reshape(h, t, -1)[..., :s], "kq_soft_max": lambda a: a.reshape(h, t, -1)[..., :s],
            "kqv_out": lambda a: a.reshape(t, h * hd),
        }

    def _plan(self, n: int, u: int, rows):
        """-> [(first token, end, kept rows relative to the micro-batch or None for all)] per micro-batch."""
        out = []
        for a in range(0, n, u):
            b = min(n, a + u)
            out.append((a, b, None if rows is None else [r - a for r in rows if a <= r < b]))
        return out

    def _plan_of(self, name, plan, splan):
        return splan if splan is not None and name in self.score_names else plan

    def _rows_of(self, plan, splan=None):
        """Capture.rows: what to copy out of a node as it is computed: its kept rows of the micro-batch (the
        score rows for kq/kq_soft_max where given), nothing where none is kept, a cache only from the last
        micro-batch; the whole node where every row is kept. The other rows are never read."""
        def rows(g, name):
            if name == "result_output":                 # the graph's last node, a boundary: its logits come from
                return (0, [])                          # llama.cpp's output buffer, never read here
            ax = self.axis.get(name, "whole")
            if ax is None:
                return None if g == len(plan) - 1 else (0, [])
            p = self._plan_of(name, plan, splan)
            sel = p[g][2] if g < len(p) else None
            if ax == "whole" or sel is None:
                return None
            if not sel:
                return (ax, [])
            if p[g][1] - p[g][0] == 1:                 # one token: ggml dropped its size-1 axis
                return None
            return (ax, sel)
        return rows

    def _spilled(self, arr):
        """A captured part, written to the capture's store where there is one (read back by _parts)."""
        if arr is None or self.spill is None:
            return arr
        key = str(len(self.spill))
        self.spill[key] = arr
        return _Spilled(self.spill, key)

    def run(self, ref, tokens, pos: int, step: int = 0, logits_to=None):
        """One forward of `tokens` at `pos` (pos 0: a fresh sequence), every checkpoint node written at `step`;
        -> its logits [T, V]. With a store on disk, a fresh forward's logits are written to it batch by batch
        (under logits_to, else a name of the capture's own) and come back as StoredRows."""
        plan = self._plan(len(tokens), ref.n_ubatch, self.rows if step == 0 else None)
        splan = self._plan(len(tokens), ref.n_ubatch, self.score_rows) if step == 0 and self.score_rows else None
        cap = Capture(names=self.names, rows=self._rows_of(plan, splan), keep=lambda g, name, arr: self._spilled(arr))
        if pos == 0:
            logits = self._kept_logits(ref, tokens, cap, logits_to)
        else:
            logits = ref.eval_at(tokens, pos, cap)
        if len(cap.graphs) != len(plan):
            raise ReferenceError_(f"llama.cpp ran {len(cap.graphs)} graph(s) for {len(tokens)} tokens with n_ubatch "
                                  f"{ref.n_ubatch}; {len(plan)} were expected")
        wanted = list(self._wanted(step))
        uses = Counter(key for _, _, _, key in wanted)
        for s, ts, layer, key in wanted:
            name = key[0]
            parts = self._parts(cap, self._plan_of(name, plan, splan), key, ts, pos)
            uses[key] -= 1
            if not uses[key]:
                self._drop(cap, key)          # its parts' disk given back as soon as none is read again
            if parts is None:
                if self.flash_attn and ts.ours in FUSED_BY_FLASH_ATTN:
                    continue                   # fused into one op: not covered, never passed
                raise ReferenceError_(f"llama.cpp produced no node {key} (captured {len(cap.nodes)})")
            a = _join(parts, ts.ours, self.axis.get(name), pos + len(tokens))
            if self.axis.get(name) == "whole" and step == 0:
                a = select_rows(catalogue()[(s.id, ts.ours)], a, self.rows)
            self.put(f"cp{s.id}.{ts.ours}" + ("" if layer is None else f".layer{layer}"), a, step=step)
        for key in {k for graph in cap.graphs for k in graph}:      # captured and never read: none expected
            self._drop(cap, key)
        return logits

    def _wanted(self, step: int):
        """-> (spec, tensor spec, layer, llama.cpp node key) of every node a forward at `step` writes, in order."""
        cfg = self.cfg
        for s in self.specs:
            if step and s.scope != "layer" and s.id != "8":     # a decode step: layers, its final norm, logits
                continue
            for ts in s.tensors_for(cfg):
                lc = ts.node(cfg)
                if lc is None:                         # unnamed in this architecture's graph: not covered
                    continue
                for layer in (range(cfg.n_layers) if s.scope == "layer" else [None]):
                    name = lc["name"].replace("{L}", str(layer))
                    yield s, ts, layer, (name, lc["op"], int(lc.get("occurrence", 0)))

    def _drop(self, cap, key):
        """The captured parts of a node, read for the last time: deleted from the capture's store on disk."""
        for graph in cap.graphs:
            part = graph.pop(key, None)
            if isinstance(part, _Spilled):
                del part.store[part.key]

    def _parts(self, cap, plan, key, ts, pos):
        """-> [(first kept row, array in the canonical layout)] per micro-batch holding the node; None if none."""
        parts, kept = [], 0
        for g, (a, b, sel) in enumerate(plan):
            arr = cap.graphs[g].get(key)
            n = (b - a) if sel is None or self.axis.get(key[0]) == "whole" else len(sel)
            if isinstance(arr, _Spilled):
                arr = arr.load()
            if arr is not None:
                fn = self.canonical(n, pos + b).get(ts.ours, lambda x, n=n: x.reshape(n, -1))
                parts.append((kept, fn(ts.from_llamacpp(self.cfg, arr))))
            kept += n
        return parts or None

    def _kept_logits(self, ref, tokens, cap, logits_to=None):
        """A fresh forward of the prompt -> the logits of the rows kept [R, V], gathered batch by batch: an
        array, or with a store on disk StoredRows, written batch by batch (never [R, V] in memory; in the
        declared array order's shape, the same bytes)."""
        rows = self.rows
        keep = list(range(len(tokens))) if rows is None else rows
        where = {r: i for i, r in enumerate(keep)}
        if self.spill is not None:
            store, name = (self.rec.tensors, logits_to) if logits_to else (self.spill, "logits")
            shape = (len(keep), ref.n_vocab)
            with store.row_writer(name, shape[::-1] if self.array_order == "ggml" else shape, np.float32) as w:
                ref.eval(tokens, cap, sink=lambda a, part: w.write(
                    part if rows is None else part[[r - a for r in range(a, a + len(part)) if r in where]]))
            return StoredRows(store, name, len(keep))
        out = np.empty((len(keep), ref.n_vocab), dtype=np.float32)

        def sink(a, part):
            mine = [r for r in range(a, a + len(part)) if r in where]
            if mine:
                out[[where[r] for r in mine]] = part[[r - a for r in mine]]
        ref.eval(tokens, cap, sink=sink)
        return out

    def decode(self, ref, t: int, last_logits, steps: int, decode_ids):
        """Decode steps on the prompt's cache: step k feeds decode_ids[k-1] (or llama.cpp's greedy pick)."""
        fed = [int(x) for x in decode_ids] if decode_ids is not None else []
        for k in range(1, steps + 1):
            if decode_ids is None:
                fed.append(int(np.argmax(last_logits)))
            last_logits = self.run(ref, fed[k - 1:k], pos=t + k - 1, step=k)[-1]
            self.put("cp8.logits", last_logits[None, :], step=k)
        self.rec.extra["decode_token_ids"] = fed


class _Spilled:
    """A captured part held in a SpillStore: load() reads it back."""

    def __init__(self, store, key):
        self.store, self.key = store, key

    def load(self):
        return self.store[self.key]


def _join(parts, ours: str, axis, s: int) -> np.ndarray:
    """Micro-batches' parts of one tensor -> the prompt's: rows concatenated; kq/kq_soft_max placed in [H, T, S]
    (a query's entries beyond its micro-batch were never computed: 0); a cache: the last micro-batch's."""
    if axis is None or len(parts) == 1:
        return parts[-1][1]
    if ours in ("kq", "kq_soft_max"):
        h = parts[0][1].shape[0]
        n = sum(p.shape[1] for _, p in parts)
        out = np.zeros((h, n, s), dtype=np.float32)
        for r0, p in parts:
            out[:, r0:r0 + p.shape[1], :p.shape[2]] = p
        return out
    return np.concatenate([p for _, p in parts], axis=0)


def llama_cpp_version() -> str:
    import llama_cpp
    return llama_cpp.__version__


def _check_context(ctx, path, n_ctx: int, **settings):
    """An open llama.cpp context reused for a dump must run the same file, hold the positions, and have the
    settings asked for: else the dump would silently describe another run."""
    if Path(ctx.path).resolve() != Path(path).resolve():
        raise ParameterError(f"the llama.cpp context given runs {ctx.path}, not {path}")
    if ctx.n_ctx < n_ctx:
        raise ParameterError(f"the llama.cpp context given holds {ctx.n_ctx} positions; this run needs {n_ctx}")
    for k, v in settings.items():
        if ctx.settings.get(k) != v:
            raise ParameterError(f"the llama.cpp context given has {k}={ctx.settings.get(k)!r}; this run asks "
                                 f"for {v!r}")


def hf_folder_for(path) -> Path:
    """A Hugging Face folder for transformers: PATH itself, or the GGUF file converted once into
    $LLORCH_HOME/hf/<sha256 prefix>/ (dequantized, Q/K rows un-permuted: llorch-ref convert --to hf)."""

    p = Path(path)
    if p.is_dir():
        return p
    out = home() / "hf" / f"{p.stem}-{sha256_file(p)[:12]}"
    if not (out / "config.json").exists():
        import sys

        print(f"llorch-ref: converting {p.name} to a Hugging Face folder: {out}", file=sys.stderr)
        convert_gguf_to_hf(p, out, overwrite=True)
    return out


def dump_transformers(path, prompt=None, token_ids=None, n_greedy=32, decode_steps=0, decode_ids=None,
                      rows=None, n_ubatch=None) -> Recorder:
    """transformers (float32, eager attention, CPU) on a Hugging Face folder -> Recorder, through forward
    hooks. Layout: token-major, Hugging Face (NeoX) RoPE pairs. The raw Q.K^T scores (checkpoint 4 'kq')
    are not exposed by transformers and are left out (not covered). Decode steps after the prompt on its
    cache: the tokens decode_ids when given (teacher forcing), else decode_steps greedy tokens. rows: the
    prompt's rows the dump keeps (the Recorder cuts each tensor as it is added). n_ubatch: feed the prompt in
    micro-batches of this many tokens on one cache (their rows put together, as llama.cpp's n_ubatch)."""
    torch, transformers = _import_hf()
    folder = hf_folder_for(path)
    model = _load_hf_model(torch, transformers, folder)
    tok = transformers.AutoTokenizer.from_pretrained(str(folder)) if prompt is not None else None
    if token_ids is None:
        if tok is None:
            raise ParameterError("give a prompt or token ids")
        token_ids = tok(prompt, add_special_tokens=True)["input_ids"]
    c = model.config
    ids = check_token_ids(token_ids, c.vocab_size, c.max_position_embeddings)
    rec = Recorder("transformers", f"{transformers.__version__} (torch {torch.__version__})",
                   model_path=folder, token_ids=ids, prompt=prompt, layouts={"rope_pairs": "neox"},
                   rows=check_rows(rows, len(ids)),
                   notes="float32, eager attention, CPU; RoPE outputs captured by wrapping apply_rotary_pos_emb",
                   extra={"arithmetic": {"numerics": "exact", "kv_dtype": "float32",
                                         "settings": {"dtype": "float32", "attn_implementation": "eager",
                                                      "n_ubatch": n_ubatch or len(ids)}}})
    if tok is not None:
        rec.add("cp0.token_ids", np.array(tok(prompt, add_special_tokens=True)["input_ids"], dtype=np.int64))
    x = torch.tensor([ids])
    at = types.SimpleNamespace(t=len(ids), step=0)          # what the hooks record into: tokens, step
    u = len(ids) if not n_ubatch or n_ubatch >= len(ids) else int(n_ubatch)
    parts = _Parts()
    hooks = _layer_hooks(model, parts, at)
    try:
        with torch.no_grad():
            out = _hf_prompt(torch, model, parts, at, x, u)
        parts.put_into(rec, len(ids))
        rec.add("cp8.logits", out.logits[0])
        parts.rec, at.step = rec, 0                  # decode steps record straight into the dump
        steps = len(decode_ids) if decode_ids is not None else int(decode_steps)
        if steps:
            _hf_decode(torch, model, rec, at, out, steps, decode_ids)
    finally:
        for hk in hooks:
            hk.remove()
    with torch.no_grad():                                  # the same forward(s) without hooks or wrapped RoPE
        plain = _hf_prompt(torch, model, None, at, x, u).logits[0]
        rec.extra["capture_invariance"] = capture_invariance(out.logits[0].numpy(), plain.numpy())
        rec.add("cp9.logits", model(x, logits_to_keep=1).logits[0, -1])
        if n_greedy > 0:
            rec.add("cp12.greedy_tokens", np.array(_hf_greedy(torch, model, x, n_greedy), dtype=np.int64))
    return rec


def hf_tokenize(path, prompt: str) -> list[int]:
    """The prompt's ids as the transformers writer tokenizes it (the folder's tokenizer, special tokens added)."""
    _, transformers = _import_hf()
    tok = transformers.AutoTokenizer.from_pretrained(str(hf_folder_for(path)))
    return tok(prompt, add_special_tokens=True)["input_ids"]


class _Parts:
    """What the hooks record: into `rec` when set (decode steps), else per micro-batch of the prompt, put
    together afterwards: rows concatenated, probabilities placed at their positions, caches from the last."""

    def __init__(self):
        self.rec, self.parts = None, []

    def add(self, name, a, step=0):
        if self.rec is not None:
            return self.rec.add(name, a, step=step)
        self.parts[-1][2][name] = a.detach().float().numpy().copy() if hasattr(a, "detach") else np.asarray(a)

    def put_into(self, rec: Recorder, n: int):
        for name in self.parts[-1][2]:
            have = [(a, b, p[name]) for a, b, p in self.parts if name in p]
            if ".k_cache." in name or ".v_cache." in name:
                if have[-1][1] == n:
                    rec.add(name, have[-1][2])
            elif name.startswith("cp4.kq_soft_max"):
                full = np.zeros(have[0][2].shape[:1] + (n, n), dtype=np.float32)
                for a, b, p in have:
                    full[:, a:b, b - p.shape[-1]:b] = p
                rec.add(name, full)
            else:
                rec.add(name, np.concatenate([p for _, _, p in have], axis=0))


def _hf_prompt(torch, model, parts, at, x, u: int):
    """The prompt through the model in micro-batches of u tokens on one cache (all at once when u >= T); with
    parts, every hook and the RoPE outputs recorded per micro-batch. -> (logits [1, T, V], the cache)."""
    cache, logits, n = None, [], x.shape[1]
    for a in range(0, n, u):
        b = min(n, a + u)
        at.t = b - a
        if parts is not None:
            parts.parts.append((a, b, {}))
        ctx = _rope_outputs(model) if parts is not None else contextlib.nullcontext([])
        with ctx as roped:
            o = model(x[:, a:b], past_key_values=cache, use_cache=True, output_attentions=parts is not None)
        if parts is not None:
            _add_rope_caches_scores(parts, model.config, roped, o, b)
        cache = o.past_key_values
        logits.append(o.logits)
    at.t = n
    return types.SimpleNamespace(logits=torch.cat(logits, dim=1), past_key_values=cache)


def _import_hf():
    try:
        import torch
        import transformers
    except ImportError as e:
        raise ReferenceError_(f"transformers reference needs torch and transformers: pip install -e '.[hf]' ({e})") from None
    return torch, transformers


HF_MODEL_TYPES = ("llama", "mistral", "qwen2", "phi3", "gemma3_text", "gpt2")
NO_ROPE_TYPES = ("gpt2",)           # learned positions: no RoPE outputs to capture


def _load_hf_model(torch, transformers, folder):
    torch.manual_seed(0)
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32,
                                                                  attn_implementation="eager")
    except TypeError:                                  # transformers < 4.56 names it torch_dtype
        model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), torch_dtype=torch.float32,
                                                                  attn_implementation="eager")
    model.eval()
    if model.config.model_type not in HF_MODEL_TYPES:
        raise ReferenceError_(f"{folder}: model_type {model.config.model_type!r}: the transformers hooks know "
                              f"{', '.join(HF_MODEL_TYPES)}")
    return model


def _out(o):
    return o[0] if isinstance(o, tuple) else o


def _layer_hooks(model, rec: Recorder, at) -> list:
    """Forward (and pre-forward) hooks that add every layer tensor to rec, in the canonical names, for a
    forward of at.t tokens at step at.step."""
    c = model.config
    if c.model_type == "gpt2":
        return _gpt2_hooks(model, rec, at)
    h, kv = c.num_attention_heads, c.num_key_value_heads
    hd = getattr(c, "head_dim", None) or c.hidden_size // h
    gemma = c.model_type == "gemma3_text"
    hooks = []

    def fwd(mod, name, i, fn=lambda a: a[0]):
        hooks.append(mod.register_forward_hook(
            lambda m, inp, o: rec.add(f"{name}.layer{i}", fn(_out(o)), step=at.step)))

    def pre(mod, name, i, fn=lambda a: a[0]):
        hooks.append(mod.register_forward_pre_hook(
            lambda m, inp: rec.add(f"{name}.layer{i}", fn(inp[0]), step=at.step)))

    def split_qkv(i):                         # Phi-3: one projection, rows Q | K | V
        def hook(m, inp, o):
            o, nq, nk, t = _out(o)[0], h * hd, kv * hd, at.t
            rec.add(f"cp2.q_proj.layer{i}", o[:, :nq].reshape(t, h, hd), step=at.step)
            rec.add(f"cp2.k_proj.layer{i}", o[:, nq:nq + nk].reshape(t, kv, hd), step=at.step)
            rec.add(f"cp2.v.layer{i}", o[:, nq + nk:].reshape(t, kv, hd), step=at.step)
        return hook

    for i, lyr in enumerate(model.model.layers):
        attn, mlp = lyr.self_attn, lyr.mlp
        fwd(lyr.input_layernorm, "cp1.attn_norm", i)
        if hasattr(attn, "qkv_proj"):
            hooks.append(attn.qkv_proj.register_forward_hook(split_qkv(i)))
        else:
            for mod, name, heads in ((attn.q_proj, "cp2.q_proj", h), (attn.k_proj, "cp2.k_proj", kv), (attn.v_proj, "cp2.v", kv)):
                fwd(mod, name, i, lambda a, heads=heads: a[0].reshape(at.t, heads, hd))
        pre(attn.o_proj, "cp5.kqv_out", i)
        fwd(attn.o_proj, "cp5.attn_out", i)
        if gemma:          # four norms per layer; QK-norm runs on head-major [1, heads, T, Hd]
            fwd(attn.q_norm, "cp2.q_normed", i, lambda a: a[0].transpose(0, 1))
            fwd(attn.k_norm, "cp2.k_normed", i, lambda a: a[0].transpose(0, 1))
            fwd(lyr.post_attention_layernorm, "cp5.attn_post_norm", i)
            pre(lyr.pre_feedforward_layernorm, "cp5.ffn_inp", i)
            fwd(lyr.pre_feedforward_layernorm, "cp1.ffn_norm", i)
            fwd(lyr.post_feedforward_layernorm, "cp6.ffn_post_norm", i)
        else:
            pre(lyr.post_attention_layernorm, "cp5.ffn_inp", i)
            fwd(lyr.post_attention_layernorm, "cp1.ffn_norm", i)
        pre(mlp.down_proj, "cp6.ffn_swiglu", i)
        fwd(mlp, "cp6.ffn_out", i)
        fwd(lyr, "cp7.l_out", i)
    hooks.append(model.model.norm.register_forward_hook(
        lambda m, i, o: rec.add("cp8.result_norm", _out(o)[0], step=at.step)))
    return hooks


def _gpt2_hooks(model, rec: Recorder, at) -> list:
    """GPT2LMHeadModel's hooks: ln_1, the fused c_attn (Q | K | V after its bias), c_proj's input and output, ln_2's
    input and output, the MLP's hidden (c_proj's input: GELU of c_fc) and output, the block, ln_f."""
    h = model.config.n_head
    hd = model.config.n_embd // h
    hooks = []

    def fwd(mod, name, i):
        hooks.append(mod.register_forward_hook(lambda m, inp, o: rec.add(f"{name}.layer{i}", _out(o)[0], step=at.step)))

    def pre(mod, name, i):
        hooks.append(mod.register_forward_pre_hook(lambda m, inp: rec.add(f"{name}.layer{i}", inp[0][0], step=at.step)))

    def split_qkv(i):
        def hook(m, inp, o):
            for j, name in enumerate(("cp2.q_proj", "cp2.k_proj", "cp2.v")):
                rec.add(f"{name}.layer{i}", o[0][:, j * h * hd:(j + 1) * h * hd].reshape(at.t, h, hd), step=at.step)
        return hook

    for i, blk in enumerate(model.transformer.h):
        fwd(blk.ln_1, "cp1.attn_norm", i)
        hooks.append(blk.attn.c_attn.register_forward_hook(split_qkv(i)))
        pre(blk.attn.c_proj, "cp5.kqv_out", i)
        fwd(blk.attn.c_proj, "cp5.attn_out", i)
        pre(blk.ln_2, "cp5.ffn_inp", i)
        fwd(blk.ln_2, "cp1.ffn_norm", i)
        pre(blk.mlp.c_proj, "cp6.ffn_swiglu", i)
        fwd(blk.mlp, "cp6.ffn_out", i)
        fwd(blk, "cp7.l_out", i)
    hooks.append(model.transformer.ln_f.register_forward_hook(
        lambda m, i, o: rec.add("cp8.result_norm", _out(o)[0], step=at.step)))
    return hooks


@contextlib.contextmanager
def _rope_outputs(model):
    """transformers applies RoPE in a module-level function: wrapped while the forward runs, it yields the
    (q, k) after RoPE of every layer, in order (none for a model without RoPE)."""
    if model.config.model_type in NO_ROPE_TYPES:
        yield []
        return
    mod = importlib.import_module(type(model.model.layers[0].self_attn).__module__)
    orig, roped = mod.apply_rotary_pos_emb, []

    def wrapped(q, k, *a, **kw):
        qe, ke = orig(q, k, *a, **kw)
        roped.append((qe, ke))
        return qe, ke
    mod.apply_rotary_pos_emb = wrapped
    try:
        yield roped
    finally:
        mod.apply_rotary_pos_emb = orig


def _add_rope_caches_scores(rec: Recorder, c, roped, out, s: int, step: int = 0):
    """RoPE outputs, K/V caches (s positions) and attention probabilities of one forward, at `step`."""
    if c.model_type not in NO_ROPE_TYPES and len(roped) != c.num_hidden_layers:
        raise ReferenceError_(f"captured RoPE outputs of {len(roped)} layers, expected {c.num_hidden_layers}")
    for i, (qe, ke) in enumerate(roped):                   # [1, H, T, Hd] head-major -> token-major
        rec.add(f"cp1B.q.layer{i}", qe[0].transpose(0, 1), step=step)
        rec.add(f"cp1B.k.layer{i}", ke[0].transpose(0, 1), step=step)
    pkv = out.past_key_values
    for i in range(c.num_hidden_layers):
        kc, vc = (pkv.layers[i].keys, pkv.layers[i].values) if hasattr(pkv, "layers") else pkv[i]
        if kc.shape[2] == s:   # a sliding-window layer keeps only its window: not the whole cache (not covered)
            rec.add(f"cp3.k_cache.layer{i}", kc[0].transpose(0, 1), step=step)   # [KV, S, Hd] -> [S, KV, Hd]
            rec.add(f"cp3.v_cache.layer{i}", vc[0].transpose(0, 1), step=step)
        probs = out.attentions[i][0]                                              # [H, T, S]
        if probs.shape[-1] < s:    # a sliding-window layer's step attends to its window's cache: the last W positions
            full = probs.new_zeros(probs.shape[:-1] + (s,))
            full[..., s - probs.shape[-1]:] = probs
            probs = full
        rec.add(f"cp4.kq_soft_max.layer{i}", probs, step=step)


def _hf_decode(torch, model, rec: Recorder, at, out, steps: int, decode_ids):
    """Decode steps on the prompt's cache (out.past_key_values), every hook recording at its step."""
    fed = [int(x) for x in decode_ids] if decode_ids is not None else []
    cache, last, n = out.past_key_values, out.logits[0, -1], at.t
    for k in range(1, steps + 1):
        if decode_ids is None:
            fed.append(int(torch.argmax(last)))
        at.t, at.step = 1, k
        with torch.no_grad(), _rope_outputs(model) as roped:
            o = model(torch.tensor([fed[k - 1:k]]), past_key_values=cache, use_cache=True, output_attentions=True)
        _add_rope_caches_scores(rec, model.config, roped, o, n + k, step=k)
        rec.add("cp8.logits", o.logits[0], step=k)
        cache, last = o.past_key_values, o.logits[0, -1]
    at.t, at.step = n, 0
    rec.extra["decode_token_ids"] = fed


def _hf_greedy(torch, model, x, n: int) -> list:
    gen, cache, step = [], None, x
    for _ in range(n):
        o = model(step, past_key_values=cache, use_cache=True, logits_to_keep=1)
        cache = o.past_key_values
        gen.append(int(torch.argmax(o.logits[0, -1])))
        step = torch.tensor([[gen[-1]]])
    return gen


def transformers_subject(model_path, token_ids, decode_steps=0):
    """The pytest-plugin subject protocol for transformers: --llorch-subject=llorch_ref.references.engines:transformers_subject"""
    return dump_transformers(model_path, token_ids=token_ids, n_greedy=16, decode_steps=decode_steps)
