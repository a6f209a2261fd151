"""What the black-box tests (test_blackbox.py, test_blackbox_faces.py) share: the prompt, the planted file, the
reference's own greedy run (conftest's blackbox_self_run, once a session), and the marks that skip, with the reason,
where llama-cpp-python's server or mistral.rs is missing."""
from __future__ import annotations

import pytest

from llorch_ref.testing.openai_server import llama_cpp_server, server_installed

PROMPT = "Once upon a time, there was a little"
# A scale error large enough to leave the bands: one matrix's 10% stays under 10 x the clean engines' per-step KLD
# (docs/engines-under-test.md, Black boxes); the last layer's down projection at 1.5x gives steps of KLD 1-4 nats.
PLANT, FACTOR = "blk.29.ffn_down.weight", 1.5


SELF_STEPS = 32          # the longest self run a test asks (the run-level bands' min_steps)


class Memo:
    """A reference engine whose logits of one token sequence are computed once, and those of its prefixes are
    its first rows (the model is causal; the self traces all share the self run's tokens)."""

    def __init__(self, eng):
        self._eng, self._seen = eng, {}

    def __getattr__(self, name):
        return getattr(self._eng, name)

    def logits(self, ids):
        key = tuple(ids)
        for seen, out in self._seen.items():
            if seen[:len(key)] == key:
                return out[:len(key)]
        self._seen[key] = self._eng.logits(list(ids))
        return self._seen[key]


def self_run(eng, n=SELF_STEPS):
    """eng's greedy run of n tokens from PROMPT: (prompt ids, tokens, its log-probabilities a step)."""
    from llorch_ref.harness.blackbox import log_softmax64

    ids = eng.tokenizer.encode(PROMPT)
    gen = list(eng.generate_ids(ids, max_tokens=n, ignore_eos=True))
    return ids, gen, log_softmax64(eng.logits(ids + gen[:-1])[len(ids) - 1:])


def planted_copy(model, folder):
    """model with PLANT scaled by FACTOR, as folder/planted.gguf."""
    from llorch_ref.testing.plant import plant_scale

    return plant_scale(model, folder / "planted.gguf", PLANT, FACTOR)


def llama_cpp_served(model):
    """A fixture's body: llama-cpp-python's server on model, its URL yielded until the fixture ends; a skip, with
    the reason, where its server extra is missing."""
    if server_installed() is not None:
        pytest.skip(str(server_installed()))
    with llama_cpp_server(model) as url:
        yield url


def mistralrs_missing():
    try:
        import mistralrs  # noqa: F401
    except ImportError:
        return "mistralrs is not installed (pip install mistralrs)"
    return None


needs_server = pytest.mark.skipif(server_installed() is not None, reason=str(server_installed()))
needs_mistralrs = pytest.mark.skipif(mistralrs_missing() is not None, reason=str(mistralrs_missing()))
