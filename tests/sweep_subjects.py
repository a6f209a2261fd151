"""Planted shape bugs for the sweep tests: llorch-ref itself (numpy, exact) as the engine under test, its logits
made wrong only where the bug's shape condition holds, so every other cell passes and each bug has one smallest case.
Called as the sweep calls a MODULE:FUNCTION subject: (model_path, token_ids, decode_steps=N, **settings)."""
from __future__ import annotations

import os

import numpy as np

import llorch_ref
from llorch_ref.references.llorch import record_engine

_ENGINES = {}


def _engine(path):
    if path not in _ENGINES:
        _ENGINES[path] = llorch_ref.load(path, weights="eager", threads=1)
    return _ENGINES[path]


def _run(model_path, token_ids, decode_steps):
    return record_engine(_engine(model_path), token_ids, n_greedy=0, decode_steps=decode_steps)


def _spoil(rec, name):
    """Noise of a tenth of the tensor's spread added to one recorded tensor (far outside any band)."""
    a = rec.tensors[name]
    rec.tensors[name] = a + 0.1 * float(a.std()) * np.random.default_rng(0).standard_normal(a.shape).astype(a.dtype)


def clean(model_path, token_ids, decode_steps=0, **settings):
    """No bug: every cell passes."""
    return _run(model_path, token_ids, decode_steps)


def wrong_at_3_mod_32(model_path, token_ids, decode_steps=0, **settings):
    """The prompt's logits wrong when the token count is 3 mod 32."""
    rec = _run(model_path, token_ids, decode_steps)
    if len(token_ids) % 32 == 3:
        _spoil(rec, "cp8.logits")
    return rec


def wrong_when_ubatch_splits(model_path, token_ids, decode_steps=0, n_ubatch=512, **settings):
    """The prompt's logits wrong when n_ubatch is smaller than the prompt (it runs as several micro-batches)."""
    rec = _run(model_path, token_ids, decode_steps)
    if n_ubatch < len(token_ids):
        _spoil(rec, "cp8.logits")
    return rec


def wrong_from_step_5(model_path, token_ids, decode_steps=0, **settings):
    """Every decode step's logits from the fifth on wrong."""
    rec = _run(model_path, token_ids, decode_steps)
    for k in range(5, decode_steps + 1):
        _spoil(rec, f"cp8.logits.step{k}")
    return rec


def dies_once(model_path, token_ids, decode_steps=0, marker=None, **settings):
    """Clean, but the process running the first cell of length 2 ends (os._exit) once: the marker file says it
    did. Its sweep runs on Ray, where that actor's cell must go to another."""
    path = os.environ["LLORCH_SWEEP_MARKER"]
    if len(token_ids) == 2 and not os.path.exists(path):
        open(path, "w").close()
        os._exit(1)
    return _run(model_path, token_ids, decode_steps)


def holds_no_ffn(model_path, token_ids, decode_steps=0, **settings):
    """No SwiGLU tensors (cp6) recorded: every cell is INCOMPLETE, none fails."""
    rec = _run(model_path, token_ids, decode_steps)
    rec.tensors = {k: v for k, v in rec.tensors.items() if not k.startswith("cp6.")}
    return rec


def wrong_for_the_second_sequence(model_path, token_ids, decode_steps=0, n_seq=1, **settings):
    """Several sequences in one batch (token_ids one list per sequence, n_seq > 1): each run alone, clean, but
    the second sequence's logits wrong whenever the batch holds two or more; one sequence is always clean."""
    if n_seq == 1:
        return _run(model_path, token_ids, decode_steps)
    recs = [_run(model_path, ids, decode_steps) for ids in token_ids]
    _spoil(recs[1], "cp8.logits")
    return recs
