"""llorch-ref's recording of a prompt holds one K/V cache at a time: the recorded forward's cache is dropped before
the forwards after it (the capture-invariance forward, the last row's, the greedy continuation's prefill) fill
their own. On an 8B-shaped model at 4,096 tokens one float32 cache is 1 GiB."""
from __future__ import annotations

import weakref

import llorch_ref
from llorch_ref.references.llorch import record_engine

TEXT = "The history of the Roman Empire spans many centuries, from the founding of the city to the fall of"


def caches_alive_at_each_forward(eng, ids, **kw) -> list[int]:
    """record_engine on eng -> for each forward it runs, how many of the caches it made are still alive."""
    made, alive = [], []
    new_cache, forward = eng.new_cache, eng.forward

    def counted_cache():
        c = new_cache()
        made.append(weakref.ref(c))
        return c

    def counted_forward(*a, **k):
        alive.append(sum(r() is not None for r in made))
        return forward(*a, **k)
    eng.new_cache, eng.forward = counted_cache, counted_forward
    try:
        record_engine(eng, ids, **kw)
    finally:
        del eng.new_cache, eng.forward
    return alive


def test_a_recording_holds_one_kv_cache_at_a_time(tiny):
    eng = llorch_ref.load(tiny(weight_type="F32", n_layers=2, vocab="bpe"), weights="eager")
    ids = eng.tokenizer.encode(TEXT)
    alive = caches_alive_at_each_forward(eng, ids, prompt=TEXT, n_greedy=3, decode_steps=2)
    assert len(alive) >= 4                 # warm-up and recorded forward, invariance, last row, greedy prefill
    assert max(alive) == 1, alive


def test_a_cache_kept_alive_is_counted(tiny, monkeypatch):
    """The count sees a cache the recording keeps: a recording that holds its first cache counts 2."""
    from llorch_ref.references import llorch as R

    held = []
    decode_steps = R._decode_steps
    monkeypatch.setattr(R, "_decode_steps", lambda engine, cache, *a: (held.append(cache), decode_steps(engine, cache, *a)))
    eng = llorch_ref.load(tiny(weight_type="F32", n_layers=2, vocab="bpe"), weights="eager")
    alive = caches_alive_at_each_forward(eng, eng.tokenizer.encode(TEXT), prompt=TEXT, n_greedy=3)
    assert max(alive) == 2, alive
