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
