"""Several sequences in one llama.cpp batch: one llama_batch holding every sequence's prompt (each row with its
sequence id), then decode steps of one token per sequence in one batch each; every sequence's tensors and
logits written to a dump of its own, as if it had run alone, so that each is checked against the reference
run of that sequence alone (a mask that lets one sequence see another's keys shows there).

The rules:

- The sequences share one unified K/V cache (kv_unified), filled in batch order from cell 0: the prompt's
  rows in the order given (sequence 0's tokens, then sequence 1's, ...), then each decode step's n rows. A
  sequence's cache (cp3) is its own cells in position order; its scores (cp4, [H, T, S]) are its rows against
  its own cells (a cell not yet in a micro-batch's view stays 0, as for one sequence).
- A batch longer than n_ubatch runs as micro-batches of n_ubatch rows in batch order (one graph each): a
  sequence's rows may share a micro-batch with another's. Each dump declares the size of the micro-batch of
  each of its rows (arithmetic settings batch_tokens), so the local reference takes every row by the product that
  micro-batch used, and the cache cell of each position, so the softmax and P.V sum over the lanes
  llama.cpp's did (harness/local.attention_by_batch).
- Decode steps are greedy per sequence (its own argmax), as one sequence's are.
"""
from __future__ import annotations

import numpy as np

from ..checkpoints import load_specs
from ..dtypes import KV_DTYPES, dtype_name
from ..dump import Recorder, capture_invariance
from ..errors import ParameterError, ReferenceError_
from ..numerics.ggml_build import simd_of
from ..references.engines import FUSED_BY_FLASH_ATTN, _LlamaCppCapture, check_token_ids, gguf_config, llama_cpp_version
from ..references.llamacpp import Capture, LlamaCpp

SEQUENCE_SHIFT = 7            # sequence j's prompt: the sweep text from its 7*j-th token on


def sequence_prompts(base: list[int], length: int, n_seq: int) -> list[list[int]]:
    """n_seq different prompts of `length` tokens: sequence j is `base` from its SEQUENCE_SHIFT*j-th token on,
    repeated as often as needed."""
    out = []
    for j in range(n_seq):
        shift = (SEQUENCE_SHIFT * j) % len(base)
        rolled = list(base[shift:]) + list(base[:shift])
        out.append((rolled * (length // len(rolled) + 1))[:length])
    return out


def micro_batch_sizes(n_rows: int, n_ubatch: int) -> list[int]:
    """Per row of a batch of n_rows: the size of the micro-batch (of n_ubatch rows, in batch order) it runs in."""
    return [min(n_ubatch, n_rows - (i // n_ubatch) * n_ubatch) for i in range(n_rows)]


def dump_llamacpp_batch(path, seqs, decode_steps: int = 0, kv_dtype="float32", flash_attn=False, n_ubatch=512,
                        n_threads=2) -> list[Recorder]:
    """llama.cpp on a GGUF file with the prompts `seqs` in one batch (module docstring) -> one Recorder per
    sequence, in order."""
    kv_dtype = dtype_name(kv_dtype, KV_DTYPES, "kv_dtype")
    cfg, specs = gguf_config(path), load_specs()
    if not seqs or n_ubatch < 1 or n_threads < 1:
        raise ParameterError("give one sequence or more; n_ubatch and n_threads >= 1")
    steps = int(decode_steps)
    seqs = [check_token_ids(s, cfg.n_vocab, cfg.context_length - steps) for s in seqs]
    n = len(seqs)
    prompt = [(tok, p, j) for j, s in enumerate(seqs) for p, tok in enumerate(s)]
    cells_needed = len(prompt) + n * steps
    ref = LlamaCpp(path, n_ctx=max(256, 64 * -(-cells_needed // 64)), kv_dtype=kv_dtype, flash_attn=flash_attn,
                   n_ubatch=n_ubatch, n_batch=max(len(prompt), n), n_threads=n_threads, n_seq=n)
    try:
        sizes = micro_batch_sizes(len(prompt), n_ubatch)
        offsets = [0] + [int(x) for x in np.cumsum([len(s) for s in seqs])]
        recs = [_recorder(path, cfg, s, j, n, ref, kv_dtype, flash_attn,
                          [sizes[i] for i, r in enumerate(prompt) if r[2] == j],
                          list(range(offsets[j], offsets[j + 1])) + [len(prompt) + k * n + j for k in range(steps)])
                for j, s in enumerate(seqs)]
        caps = [_LlamaCppCapture(r, specs, cfg, flash_attn, "ggml") for r in recs]
        cells = [[] for _ in range(n)]
        logits = _forward(ref, caps, cfg, specs, prompt, cells, step=0, flash_attn=flash_attn)
        last = [lg[-1] for lg in logits]
        fed = [[] for _ in range(n)]
        for k in range(1, steps + 1):
            rows = [(int(np.argmax(last[j])), len(seqs[j]) + k - 1, j) for j in range(n)]
            for j in range(n):
                fed[j].append(rows[j][0])
            last = [lg[-1] for lg in _forward(ref, caps, cfg, specs, rows, cells, step=k, flash_attn=flash_attn)]
            for j in range(n):
                caps[j].put("cp8.logits", last[j][None, :], step=k)
        ids_of = {s.id for s in specs}
        ref.clear()
        plain = _split(ref.decode_rows(prompt), prompt, n)
        ref.clear()
        ends = [i for i, (_, p, j) in enumerate(prompt) if p == len(seqs[j]) - 1]
        alone = ref.decode_rows(prompt, outputs=ends)           # the last row of each: checkpoint 9
        for j, rec in enumerate(recs):
            rec.extra["capture_invariance"] = capture_invariance(logits[j], plain[j])
            if steps:
                rec.extra["decode_token_ids"] = fed[j]
            if ids_of & {"8", "10", "11"}:
                caps[j].put("cp8.logits", logits[j])
            if "9" in ids_of:
                caps[j].put("cp9.logits", alone[j])
    finally:
        ref.close()
    return recs


def _recorder(path, cfg, ids, j, n, ref, kv_dtype, flash_attn, sizes, cells) -> Recorder:
    """Sequence j's Recorder: its own prompt, the batch's settings, the micro-batch size of each row and the
    cache cell of each position (its prompt's, then its decode steps')."""
    rec = Recorder("llama.cpp", f"{llama_cpp_version()} (llama-cpp-python)", model_path=path, token_ids=ids,
                   layouts={"array_order": "ggml", "rope_pairs": cfg.rope_style},
                   notes=f"sequence {j} of {n} in one batch; K/V cache {kv_dtype}, flash attention "
                         f"{'on' if flash_attn else 'off'}, n_ubatch {ref.n_ubatch}, {ref.settings['n_threads']} threads")
    rec.extra["arithmetic"] = {
        "numerics": "ggml", "ggml_simd": simd_of(ref.settings.get("build", ())), "kv_dtype": kv_dtype,
        "settings": {**ref.settings, "n_seq": n, "sequence": j, "cells": cells,
                     "batch_tokens": {"prompt": sizes, "decode": micro_batch_sizes(n, ref.n_ubatch)[j]}}}
    return rec


def _split(logits, rows, n) -> list[np.ndarray]:
    """Logits of a batch's rows -> per sequence, its rows in batch order."""
    return [logits[[i for i, r in enumerate(rows) if r[2] == j]] for j in range(n)]


def _forward(ref, caps, cfg, specs, rows, cells, step: int, flash_attn: bool) -> list[np.ndarray]:
    """One batch of rows (token, position, sequence): its cells appended to `cells` (per sequence, in batch
    order after those held), every checkpoint node written to each sequence's dump at `step` -> the logits
    of each sequence's rows."""
    first = sum(len(c) for c in cells)
    for i, (_, _, j) in enumerate(rows):
        cells[j].append(first + i)
    cap = Capture(names=caps[0].names)
    logits = ref.decode_rows(rows, cap)
    u = ref.n_ubatch
    plan = [(a, min(len(rows), a + u)) for a in range(0, len(rows), u)]
    if len(cap.graphs) != len(plan):
        raise ReferenceError_(f"llama.cpp ran {len(cap.graphs)} graph(s) for a batch of {len(rows)} rows with "
                              f"n_ubatch {u}; {len(plan)} were expected")
    mine = [[i for i, r in enumerate(rows) if r[2] == j] for j in range(len(caps))]
    for s in specs:
        if step and s.scope != "layer" and s.id != "8":
            continue
        for ts in s.tensors_for(cfg):
            lc = ts.node(cfg)
            if lc is None:
                continue
            for layer in (range(cfg.n_layers) if s.scope == "layer" else [None]):
                name = lc["name"].replace("{L}", str(layer))
                key = (name, lc["op"], int(lc.get("occurrence", 0)))
                arrs = [g.get(key) for g in cap.graphs]
                if all(a is None for a in arrs):
                    if flash_attn and ts.ours in FUSED_BY_FLASH_ATTN:
                        continue
                    raise ReferenceError_(f"llama.cpp produced no node {key} (captured {len(cap.nodes)})")
                arrs = [None if a is None else ts.from_llamacpp(cfg, a) for a in arrs]
                out = name_of(s.id, ts.ours, layer)
                for j, c in enumerate(caps):
                    c.put(out, _sequence_part(c, ts.ours, c.axis.get(name), arrs, plan, mine[j], cells[j]),
                          step=step)
    return _split(logits, rows, len(caps))


def name_of(cp: str, ours: str, layer) -> str:
    return f"cp{cp}.{ours}" + ("" if layer is None else f".layer{layer}")


def _sequence_part(c, ours, axis, arrs, plan, rows, cells) -> np.ndarray:
    """One sequence's part of a node (its arrays per micro-batch): its rows; its own cells of a cache; its rows
    against its own cells of the scores."""
    cfg = c.cfg
    if axis == "whole":
        raise ReferenceError_(f"{ours}: a node without one token axis is not split by sequence")
    if axis is None:                                   # a cache, as the last micro-batch left it: its cells
        a = arrs[-1]
        hd, kv = cfg.head_dim, cfg.n_kv_heads
        full = (a.reshape(hd, kv, -1).transpose(2, 1, 0) if ours == "v_cache" and not c.flash_attn
                else a.reshape(-1, kv, hd))
        if max(cells) >= full.shape[0]:
            raise ReferenceError_(f"{ours}: cell {max(cells)} beyond the view of {full.shape[0]} cells")
        return full[cells]
    if ours in ("kq", "kq_soft_max"):
        out = np.zeros((cfg.n_heads, len(rows), len(cells)), dtype=np.float32)
        cj = np.asarray(cells)
        for r, i in enumerate(rows):
            g = next(k for k, (a, b) in enumerate(plan) if a <= i < b)
            a0, b0 = plan[g]
            m = arrs[g].reshape(cfg.n_heads, b0 - a0, -1)
            ok = cj < m.shape[2]
            out[:, r, ok] = m[:, i - a0, cj[ok]]
        return out
    parts = []
    for (a0, b0), arr in zip(plan, arrs):
        t = b0 - a0
        fn = c.canonical(t, 0).get(ours, lambda x, t=t: x.reshape(t, -1))
        parts.append(fn(arr))
    return np.concatenate(parts, axis=0)[rows]
