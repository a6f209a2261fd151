"""A real server on loopback (uvicorn in a thread), for real clients (httpx, openai)."""
from __future__ import annotations

import pytest
from live_server import LiveServer


@pytest.fixture(scope="session")
def tiny_engine(tiny):
    import llorch_ref

    return llorch_ref.load(tiny(vocab="bpe"))


@pytest.fixture(scope="module")
def server(tiny_engine):
    s = LiveServer(tiny_engine)
    yield s
    s.stop()
