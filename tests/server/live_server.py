"""A real llorch-ref server on loopback: uvicorn in a thread, on a free port."""
from __future__ import annotations

import socket
import threading
import time


class LiveServer:
    def __init__(self, engine, **kw):
        from llorch_ref.server.app import create_app
        from llorch_ref.server.connections import make_server

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        header_timeout = kw.pop("header_timeout", 10.0)
        self.app = create_app(engine, **kw)
        self.server = make_server(self.app, "127.0.0.1", self.port, header_timeout=header_timeout,
                                  timeout_keep_alive=2)
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
