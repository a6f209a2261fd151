"""Misbehaving clients: each gets the right status, and the server stays healthy."""
from __future__ import annotations

import os
import socket

import httpx
import pytest
from live_server import LiveServer


def rss_mb() -> float:
    with open(f"/proc/{os.getpid()}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


@pytest.fixture(scope="module")
def hserver(tiny_engine):
    s = LiveServer(tiny_engine, max_queue=4)
    s.app.user_middleware  # noqa: B018 (touch: the guard is installed by create_app)
    yield s
    s.stop()


def test_malformed_json_is_400(hserver):
    r = httpx.post(hserver.url + "/execute", content=b'{"prompt": "hi", ', headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "INVALID_REQUEST"


def test_invalid_utf8_is_400(hserver):
    r = httpx.post(hserver.url + "/execute", content=b'{"prompt": "\xff\xfe"}', headers={"content-type": "application/json"})
    assert r.status_code == 400


def test_wrong_content_type_is_415(hserver):
    r = httpx.post(hserver.url + "/execute", content=b"prompt=hi", headers={"content-type": "application/x-www-form-urlencoded"})
    assert r.status_code == 415 and r.json()["error"]["code"] == "UNSUPPORTED_MEDIA_TYPE"


def test_body_over_limit_is_413(hserver):
    big = b'{"prompt": "' + b"a" * (2 << 20) + b'"}'
    r = httpx.post(hserver.url + "/execute", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413


def test_half_sent_request_times_out_with_408(tiny_engine):
    s = LiveServer(tiny_engine, body_timeout=1.0)
    try:
        with socket.create_connection(("127.0.0.1", s.port), timeout=10) as c:
            c.sendall(b"POST /execute HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 100\r\n\r\n{\"prompt\":")
            reply = c.recv(4096)
        assert b" 408 " in reply.split(b"\r\n")[0]
        assert httpx.get(s.url + "/health").json()["status"] == "healthy"
    finally:
        s.stop()


def test_prompt_over_the_context_is_400(hserver):
    r = httpx.post(hserver.url + "/execute", json={"prompt": "word " * 500})
    assert r.status_code == 400 and "prompt" in r.json()["error"]["fields"]


def test_soak_thousands_of_requests_memory_flat(hserver):
    """2000 requests on loopback (valid short generations, bad fields, health checks): every answer has
    the expected status and the server process's resident memory stays flat."""
    n = 2000
    counts = {}
    with httpx.Client(base_url=hserver.url, timeout=30) as c:
        for i in range(200):                                     # warm-up: allocator, caches, compiled regexes
            c.post("/execute", json={"prompt": "Once", "max_tokens": 2, "seed": i}).read()
        start = rss_mb()
        for i in range(n):
            k = i % 4
            if k == 0:
                r = c.post("/execute", json={"prompt": "Once", "max_tokens": 2, "seed": i})
                ok = r.status_code == 200 and '"type": "end"' in r.text
            elif k == 1:
                r = c.post("/execute", json={"prompt": "Once", "max_tokens": -5})
                ok = r.status_code == 400
            elif k == 2:
                r = c.post("/v1/completions", json={"prompt": "Once", "max_tokens": 2, "temperature": 0})
                ok = r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("length", "stop")
            else:
                r = c.get("/health")
                ok = r.status_code == 200
            counts[ok] = counts.get(ok, 0) + 1
        end = rss_mb()
    print(f"soak: {n} requests, {counts.get(False, 0)} unexpected answers, RSS {start:.1f} MB -> {end:.1f} MB")
    assert counts.get(False, 0) == 0
    assert end - start < 25, (start, end)


@pytest.mark.parametrize("payload", [b"", b"POST /execute HTTP/1.1\r\nHost: x\r\n", b"GE"])
def test_idle_and_half_header_connections_are_closed(tiny_engine, payload):
    """A connection that never completes a request's headers is closed after the header deadline (uvicorn
    alone kept both open for good), and the server stays healthy."""
    import time

    s = LiveServer(tiny_engine, header_timeout=1.0)
    try:
        with socket.create_connection(("127.0.0.1", s.port), timeout=20) as c:
            if payload:
                c.sendall(payload)
            t0 = time.monotonic()
            assert c.recv(100) == b""                      # closed by the server, nothing sent
            assert time.monotonic() - t0 < 10
        assert httpx.get(s.url + "/health").json()["status"] == "healthy"
        with httpx.Client(base_url=s.url) as client:       # a kept-alive client is not cut between requests
            for _ in range(3):
                assert client.get("/health").status_code == 200
                time.sleep(0.6)
    finally:
        s.stop()


def test_descriptor_exhaustion_logs_a_line_not_a_flood(tiny, tmp_path):
    """150 idle sockets against a server limited to 64 open files: a couple of `llorch-ref:` lines (asyncio
    alone printed 75,666 tracebacks in 8 s), and the server answers once the sockets are gone."""
    import resource
    import subprocess
    import sys
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "llorch_ref.cli", "serve", "--model", str(tiny()), "--port",
                             str(port)], stdout=log, stderr=subprocess.STDOUT,
                            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64)))
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.time() + 60
        while True:
            try:
                httpx.get(url + "/health", timeout=2)
                break
            except httpx.HTTPError:
                assert time.time() < deadline and proc.poll() is None
                time.sleep(0.2)
        socks = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(150)]
        time.sleep(6)
        for c in socks:
            c.close()
        time.sleep(1)
        assert httpx.get(url + "/health", timeout=10).status_code == 200
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()
    text = (tmp_path / "serve.log").read_text()
    assert "Traceback" not in text and len(text.splitlines()) < 10, text[:2000]
    assert "cannot accept connections" in text
