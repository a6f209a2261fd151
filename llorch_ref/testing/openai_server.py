"""OpenAI-compatible servers as subjects for tests and tools, each its own process on 127.0.0.1 and a free port,
stopped after: llama-cpp-python's own (the `server` extra) with its default settings (logits_all on, which its
logprobs need), and `llorch-ref serve`.

    with llama_cpp_server("m.gguf") as url:
        trace = openai_trace(url, prompt, tokenizer)
"""
from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import urllib.request


def server_installed() -> str | None:
    """None where llama_cpp.server can be imported, else why not (a skip reason)."""
    try:
        import llama_cpp.server.app  # noqa: F401
    except ImportError as e:
        return f"llama-cpp-python's server extra is not installed (pip install 'llama-cpp-python[server]'): {e}"
    return None


def free_port() -> int:
    """A TCP port of 127.0.0.1 nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serving(cmd: list, port: int, probe: str, timeout: float = 120.0, log=None):
    """Run `cmd` (a server listening on 127.0.0.1:port) as its own process; yield its URL once `probe` answers;
    terminate it (then kill) on the way out. `log`: a file its output goes to."""
    out = open(log, "wb") if log else subprocess.DEVNULL
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{' '.join(cmd)} exited with {proc.returncode} before answering")
            try:
                with urllib.request.urlopen(url + probe, timeout=2):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{' '.join(cmd)} did not answer on {url} in {timeout:g} s") from None
                time.sleep(0.3)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if log:
            out.close()


def llama_cpp_server(model, port: int | None = None, timeout: float = 120.0, log=None, extra=()):
    """`python -m llama_cpp.server --model MODEL --host 127.0.0.1 --port PORT --logits_all true`, served (as
    `serving`) once /v1/models answers."""
    port = port or free_port()
    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(model), "--host", "127.0.0.1", "--port", str(port),
           "--logits_all", "true", *extra]
    return serving(cmd, port, "/v1/models", timeout, log)


def llorch_serve(model, port: int | None = None, timeout: float = 120.0, log=None, extra=("--threads", "1")):
    """`llorch-ref serve --model MODEL --threads 1` on 127.0.0.1, served (as `serving`) once /health answers."""
    port = port or free_port()
    cmd = [sys.executable, "-m", "llorch_ref.cli", "serve", "--model", str(model), "--port", str(port), *extra]
    return serving(cmd, port, "/health", timeout, log)
