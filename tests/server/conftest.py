"""A real server on loopback (uvicorn in a thread), for real clients (httpx, openai)."""
from __future__ import annotations

import socket
import threading
import time

import pytest


class LiveServer:
    def __init__(self, engine, **kw):
        import uvicorn

        from llorch_ref.server.app import create_app

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.app = create_app(engine, **kw)
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port,
                                                    log_level="warning", timeout_keep_alive=2))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 20
        while not self.server.started:
            if time.time() > deadline:
                raise RuntimeError("server did not start")
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self):
        self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.fixture(scope="session")
def tiny_engine(tiny):
    import llorch_ref

    return llorch_ref.load(tiny(vocab="bpe"))


@pytest.fixture(scope="module")
def server(tiny_engine):
    s = LiveServer(tiny_engine)
    yield s
    s.stop()
