"""llorch-ref itself as a source of tensors: a dump of one forward (or one decode step) on any backend and
numerics, in the canonical layout, so it can be either side of a comparison."""
from __future__ import annotations

import numpy as np

from .. import __version__
from ..dump import Recorder, capture_invariance, check_rows, invariance_figure, max_abs_diff
from ..engine import GenerationResult
from ..generate import sampling
from ..model.attention_chunks import with_chunked_attention
from ..model.ffn_chunks import with_chunked_ffn

# run through the cache (then reset) before the recorded forward: a cache leaking state between sequences
# then shows up as a divergence
WARMUP_PROMPT = "The quick brown fox jumps over the lazy dog, again and again and again."


def _recorder(engine, token_ids, prompt=None, rows=None, store=None, score_rows=None, **extra) -> Recorder:
    return Recorder("llorch-ref", f"{__version__} ({engine.backend.name}, {engine.numerics})",
                    model_path=engine.path, token_ids=token_ids, prompt=prompt, rows=rows, store=store,
                    score_rows=score_rows,
                    layouts={"rope_pairs": engine.qk_rows},       # Q/K rows as loaded (not as the forward rotates)
                    extra={"arithmetic": {"numerics": engine.numerics, "kv_dtype": engine.kv_dtype,
                                          **({"ggml_simd": engine.ggml_simd} if engine.ggml_simd else {}),
                                          "settings": {"backend": engine.backend.name}}, **extra})


def record_engine(engine, token_ids, prompt=None, n_greedy=32, decode_steps=0, decode_ids=None,
                  rows=None, keep=None, store=None, score_rows=None) -> Recorder:
    """llorch-ref as a dump (canonical layout): every checkpoint tensor of one forward over token_ids on a
    cache that first ran (and reset after) a warm-up sequence; the last row alone as generation asks for
    it; its argmax and softmax; n_greedy greedy tokens (EOS ignored). Then decode steps on the same cache,
    one token each, every layer tensor and the logits of each: the tokens decode_ids when given (teacher
    forcing: another engine's tokens), else decode_steps greedy tokens of its own. rows: the prompt's rows
    to keep (indices; default all), to bound a long prompt's memory; keep: the (checkpoint, tensor) pairs to
    record (default all): a comparison records only what the subject holds. store: where the tensors go
    (a tensor_file.SpillStore: to disk as they are recorded); score_rows: the rows (among `rows`) whose
    attention scores are kept (default: the rows kept). Attention runs in query-row chunks wherever
    H x T x S is large (model/attention_chunks.py: the same values), and the FFN in spans of rows wherever
    T x F is (model/ffn_chunks.py), so no forward holds a long prompt's scores or [T, F] products whole."""
    rec = _recorder(engine, token_ids, prompt, rows=check_rows(rows, len(token_ids)), store=store,
                    score_rows=score_rows)
    rec.keep = None if keep is None else {tuple(k) for k in keep}
    ops = engine.ops
    try:
        # a long forward's scores and FFN hidden only where they are recorded
        engine.ops = with_chunked_ffn(with_chunked_attention(ops))
        return _record(engine, rec, list(token_ids), prompt, n_greedy, decode_steps, decode_ids, ops)
    finally:
        engine.ops = ops


def _record(engine, rec: Recorder, ids, prompt, n_greedy, decode_steps, decode_ids, ops) -> Recorder:
    if prompt is not None and engine.tokenizer is not None:
        rec.add("cp0.token_ids", np.array(engine.tokenizer.encode(prompt), dtype=np.int64))
    cache = engine.new_cache()
    if engine.tokenizer is not None:
        warm = engine.tokenizer.encode(WARMUP_PROMPT)
        engine.forward(warm, cache, rows=[len(warm) - 1])
        cache.reset()
    b = engine.backend
    held = rec.score_rows if rec.score_rows is not None else rec.rows   # the query rows whose scores are kept
    plain = engine.ops
    engine.ops = with_chunked_ffn(with_chunked_attention(ops, keep=held), keep=rec.rows, n_rows=len(ids))
    record = lambda n, l, a: rec(n, l, b.to_numpy(a))             # noqa: E731
    try:
        # the logits of the rows kept only (the last among them), as llama.cpp computes its output rows
        if hasattr(rec.tensors, "row_writer"):     # a long prompt's [R, V] to disk a span at a time, never whole
            last = _logits_to_store(engine, rec, ids, cache, record)
            kept = None
        else:
            logits = b.to_numpy(engine.forward(ids, cache, rows=rec.rows, record=record))
            rec.add("cp8.logits", logits)
            last = np.array(logits[-1], copy=True)
            rec.add("cp10.argmax", np.array([sampling.greedy(r) for r in logits], dtype=np.int64))  # the worker's rule
            _add_probs(rec, logits)
            kept = logits
            del logits
    finally:
        engine.ops = plain
    _decode_steps(engine, cache, rec, last, decode_steps, decode_ids)
    del cache                    # each forward below fills a cache of its own: one K/V cache alive at a time
    if kept is not None:
        again = b.to_numpy(engine.forward(ids, engine.new_cache(), rows=rec.rows))
        rec.extra["capture_invariance"] = capture_invariance(kept, again)
        del again, kept
    else:
        rec.extra["capture_invariance"] = _invariance(engine, rec, ids)
    # cp9: the prompt's last row alone, as a worker's prefill computes it: the greedy run's own prefill where there
    # is one (the same forward: one prefill fewer), else a forward of its own
    if n_greedy > 0:
        res = GenerationResult()
        greedy = list(engine.generate_ids(ids, max_tokens=n_greedy, ignore_eos=True, result=res))
        rec.add("cp9.logits", b.to_numpy(res.prompt_logits)[-1])
        rec.add("cp12.greedy_tokens", np.array(greedy, dtype=np.int64))
    else:
        rec.add("cp9.logits", b.to_numpy(engine.forward(ids, engine.new_cache(), rows=[len(ids) - 1]))[-1])
    return rec


SPAN = 256             # rows of a [T, V] tensor handled at once (softmax, capture invariance)


def _add_probs(rec: Recorder, logits):
    """cp11.probs: sampling.softmax of each row (float64, stored as float32), a span of rows at a time (the same
    values: the softmax is per row), written chunk by chunk where the store is on disk."""
    if rec.keep is not None and ("11", "probs") not in rec.keep:
        return
    spans = (sampling.softmax(logits[i:i + SPAN]).astype(np.float32) for i in range(0, len(logits), SPAN))
    if hasattr(rec.tensors, "write_rows"):
        rec.tensors.write_rows("cp11.probs", logits.shape, np.float32, spans)
    else:
        rec.add("cp11.probs", np.concatenate(list(spans), axis=0))


def _logits_to_store(engine, rec: Recorder, ids, cache, record):
    """The recorded forward's logits [R, V] (R: the rows kept) written to the store on disk a span of rows at a
    time as the head computes them (model.forward's logits_sink: the same values), with their argmax (the
    worker's rule) and softmax (cp11.probs) span by span -> the last row's logits [V]."""
    b, n, v = engine.backend, len(rec.rows or ids), engine.config.n_vocab
    logits = rec.tensors.row_writer("cp8.logits", (n, v), np.float32)      # always: the invariance reads it
    probs = (rec.tensors.row_writer("cp11.probs", (n, v), np.float32)
             if rec.keep is None or ("11", "probs") in rec.keep else None)
    argmax = []

    def sink(a, part):
        part = np.asarray(b.to_numpy(part), dtype=np.float32)
        logits.write(part)
        if probs is not None:
            probs.write(sampling.softmax(part).astype(np.float32))
        argmax.extend(sampling.greedy(r) for r in part)
    last = np.array(b.to_numpy(engine.forward(ids, cache, rows=rec.rows, record=record, logits_sink=sink))[-1])
    for w in (logits, probs):
        if w is not None:
            w.close()
    rec.add("cp10.argmax", np.array(argmax, dtype=np.int64))
    return last


def _invariance(engine, rec: Recorder, ids) -> dict:
    """capture_invariance of the recorded logits, read back from the store on disk a span of rows at a time,
    against an uncaptured forward's, handed over a span at a time (neither held whole)."""
    b, n, worst = engine.backend, len(rec.rows or ids), [0.0]

    def sink(a, part):
        part = b.to_numpy(part)
        worst[0] = max(worst[0], max_abs_diff(rec.tensors.read_rows("cp8.logits", a, a + len(part), n), part))
    engine.forward(ids, engine.new_cache(), rows=rec.rows, logits_sink=sink)
    return invariance_figure(worst[0])


def _decode_steps(engine, cache, rec: Recorder, last_logits, n: int, decode_ids):
    """The decode steps after the prompt, on its cache: step k feeds decode_ids[k-1] (or its own greedy
    pick) at the next position; the fed tokens go into the manifest's decode_token_ids."""
    fed = [int(t) for t in decode_ids] if decode_ids is not None else []
    steps = len(fed) if decode_ids is not None else int(n)
    b = engine.backend
    for k in range(1, steps + 1):
        if decode_ids is None:
            fed.append(sampling.greedy(last_logits))
        hook = rec.at_step(k)
        out = engine.forward(fed[k - 1:k], cache, record=lambda name, layer, a, hook=hook: hook(name, layer, b.to_numpy(a)))
        last_logits = b.to_numpy(out)[-1]
        rec.add("cp8.logits", last_logits[None, :], step=k)
    if steps:
        rec.extra["decode_token_ids"] = fed


def engine_label(engine) -> str:
    return f"llorch-ref {__version__} ({engine.backend.name}, {engine.numerics}, K/V {engine.kv_dtype})"
