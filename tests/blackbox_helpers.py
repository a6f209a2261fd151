"""What the black-box tests (test_blackbox.py, test_blackbox_faces.py) share: the prompt, the planted file, and
the marks that skip, with the reason, where llama-cpp-python's server or mistral.rs is missing."""
from __future__ import annotations

import pytest

from llorch_ref.testing.openai_server import llama_cpp_server, server_installed

PROMPT = "Once upon a time, there was a little"
# A scale error large enough to leave the bands: one matrix's 10% stays under 10 x the clean engines' per-step KLD
# (docs/engines-under-test.md, Black boxes); the last layer's down projection at 1.5x gives steps of KLD 1-4 nats.
PLANT, FACTOR = "blk.29.ffn_down.weight", 1.5


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
