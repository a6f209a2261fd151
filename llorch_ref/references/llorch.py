"""llorch-ref itself as a source of tensors: a dump of one forward (or one decode step) on any backend and
numerics, in the canonical layout, so it can be either side of a comparison."""
from __future__ import annotations

import numpy as np

from .. import __version__
from ..dump import Recorder, capture_invariance, check_rows
from ..generate import sampling

# run through the cache (then reset) before the recorded forward: a cache leaking state between sequences
# then shows up as a divergence
WARMUP_PROMPT = "The quick brown fox jumps over the lazy dog, again and again and again."


def _recorder(engine, token_ids, prompt=None, rows=None, **extra) -> Recorder:
    return Recorder("llorch-ref", f"{__version__} ({engine.backend.name}, {engine.numerics})",
                    model_path=engine.path, token_ids=token_ids, prompt=prompt, rows=rows,
                    layouts={"rope_pairs": engine.qk_rows},       # Q/K rows as loaded (not as the forward rotates)
                    extra={"arithmetic": {"numerics": engine.numerics, "kv_dtype": engine.kv_dtype,
                                          **({"ggml_simd": engine.ggml_simd} if engine.ggml_simd else {}),
                                          "settings": {"backend": engine.backend.name}}, **extra})


def record_engine(engine, token_ids, prompt=None, n_greedy=32, decode_steps=0, decode_ids=None,
                  rows=None, keep=None) -> Recorder:
    """llorch-ref as a dump (canonical layout): every checkpoint tensor of one forward over token_ids on a
    cache that first ran (and reset after) a warm-up sequence; the last row alone as generation asks for
    it; its argmax and softmax; n_greedy greedy tokens (EOS ignored). Then decode steps on the same cache,
    one token each, every layer tensor and the logits of each: the tokens decode_ids when given (teacher
    forcing: another engine's tokens), else decode_steps greedy tokens of its own. rows: the prompt's rows
    to keep (indices; default all), to bound a long prompt's memory; keep: the (checkpoint, tensor) pairs to
    record (default all): a comparison records only what the subject holds."""
    rec = _recorder(engine, token_ids, prompt, rows=check_rows(rows, len(token_ids)))
    rec.keep = None if keep is None else {tuple(k) for k in keep}
    ids = list(token_ids)
    if prompt is not None and engine.tokenizer is not None:
        rec.add("cp0.token_ids", np.array(engine.tokenizer.encode(prompt), dtype=np.int64))
    cache = engine.new_cache()
    if engine.tokenizer is not None:
        warm = engine.tokenizer.encode(WARMUP_PROMPT)
        engine.forward(warm, cache, rows=[len(warm) - 1])
        cache.reset()
    b = engine.backend
    # the logits of the rows kept only (the last among them), as llama.cpp computes its output rows
    logits = b.to_numpy(engine.forward(ids, cache, rows=rec.rows, record=lambda n, l, a: rec(n, l, b.to_numpy(a))))
    rec.add("cp8.logits", logits)
    _decode_steps(engine, cache, rec, logits[-1], decode_steps, decode_ids)
    rec.extra["capture_invariance"] = capture_invariance(
        logits, b.to_numpy(engine.forward(ids, engine.new_cache(), rows=rec.rows)))
    rec.add("cp9.logits", b.to_numpy(engine.forward(ids, engine.new_cache(), rows=[len(ids) - 1]))[-1])
    rec.add("cp10.argmax", np.array([sampling.greedy(r) for r in logits], dtype=np.int64))
    rec.add("cp11.probs", sampling.softmax(logits))
    if n_greedy > 0:
        rec.add("cp12.greedy_tokens", np.array(list(engine.generate_ids(ids, max_tokens=n_greedy, ignore_eos=True)),
                                              dtype=np.int64))
    return rec


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
