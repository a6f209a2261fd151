"""llama-cpp-python's own OpenAI-compatible server (the `server` extra) as a subject for tests and tools: started
on 127.0.0.1 on a free port with its default settings (logits_all on, which its logprobs need), stopped after.

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
def llama_cpp_server(model, port: int | None = None, timeout: float = 120.0, log=None, extra=()):
    """Run `python -m llama_cpp.server --model MODEL --host 127.0.0.1 --port PORT --logits_all true`; yield its URL
    once /v1/models answers; terminate it (then kill) on the way out. `log`: a file its output goes to."""
    port = port or free_port()
    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(model), "--host", "127.0.0.1", "--port", str(port),
           "--logits_all", "true", *extra]
    out = open(log, "wb") if log else subprocess.DEVNULL
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"llama_cpp.server exited with {proc.returncode} before answering ({' '.join(cmd)})")
            try:
                with urllib.request.urlopen(url + "/v1/models", timeout=2):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"llama_cpp.server did not answer on {url} in {timeout:g} s") from None
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
