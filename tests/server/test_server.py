"""The HTTP worker against real clients on loopback."""
from __future__ import annotations

import concurrent.futures as cf
import json
import time

import httpx
import pytest
from live_server import LiveServer


def sse_events(resp):
    out = []
    for line in resp.iter_lines():
        if line.startswith("data: "):
            out.append(json.loads(line[6:]))
    return out


def execute(url, body, **kw):
    with httpx.stream("POST", url + "/execute", json=body, timeout=120, **kw) as r:
        assert r.status_code == 200, r.read()
        return sse_events(r)


def text_of(events):
    return "".join(e["t"] for e in events if e["type"] == "token")


def test_health_and_models(server):
    h = httpx.get(server.url + "/health").json()
    assert h["status"] == "healthy" and h["backend"] == "numpy" and h["state"] in ("idle", "busy")
    m = httpx.get(server.url + "/v1/models").json()
    assert m["data"][0]["id"] == h["model"]


def test_execute_stream_matches_the_engine(server, tiny_engine):
    body = {"job_id": "j-1", "prompt": "Once upon", "max_tokens": 20, "temperature": 0.9, "top_p": 0.9, "seed": 7}
    ev = execute(server.url, body)
    kinds = [e["type"] for e in ev]
    assert kinds[0] == "started" and kinds[-1] == "end" and set(kinds[1:-1]) <= {"token"}
    assert ev[0]["job_id"] == "j-1"
    assert [e["i"] for e in ev if e["type"] == "token"] == list(range(len(ev) - 2))
    end = ev[-1]
    assert end["stop_reason"] in ("MAX_TOKENS", "EOS") and end["seed"] == 7 and end["tokens_out"] <= 20
    alone = "".join(tiny_engine.generate("Once upon", max_tokens=20, temperature=0.9, top_p=0.9, seed=7))
    assert text_of(ev) == alone
    assert text_of(execute(server.url, body)) == alone          # same request, same seed: same text


def test_stop_sequence_is_reported_and_not_emitted(server, tiny_engine):
    full = "".join(tiny_engine.generate("Once upon", max_tokens=30))
    assert len(full) >= 4, full
    stop = full[len(full) // 2: len(full) // 2 + 2]
    ev = execute(server.url, {"prompt": "Once upon", "max_tokens": 30, "stop": [stop]})
    assert ev[-1]["stop_reason"] == "STOP_SEQUENCE" and ev[-1]["stop_sequence_matched"] == stop
    assert text_of(ev) == full[: full.index(stop)]


@pytest.mark.parametrize("body, fields", [
    ({"prompt": "hi", "max_tokens": 0}, {"max_tokens"}),
    ({"prompt": "hi", "temperature": -1, "top_p": 2}, {"temperature", "top_p"}),
    ({"prompt": "hi", "top_k": 1.5}, {"top_k"}),
    ({"prompt": ""}, {"prompt"}),
    ({"prompt": "hi", "surprise": 1}, {"surprise"}),
    ({"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, {"stop"}),
    ({"prompt": "word " * 300}, {"prompt"}),
])
def test_bad_fields_are_400_with_an_error_per_field(server, body, fields):
    r = httpx.post(server.url + "/execute", json=body)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "INVALID_REQUEST" and set(err["fields"]) == fields, err


def test_bearer_token(tiny_engine):
    s = LiveServer(tiny_engine, api_token="s3cret")
    try:
        body = {"prompt": "hi", "max_tokens": 2}
        assert httpx.post(s.url + "/execute", json=body).status_code == 401
        r = httpx.post(s.url + "/execute", json=body, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "INVALID_API_KEY"
        assert execute(s.url, body, headers={"Authorization": "Bearer s3cret"})[-1]["type"] == "end"
        assert httpx.get(s.url + "/health").status_code == 200
    finally:
        s.stop()


def test_openai_client_completions_and_chat(server):
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    c = client.completions.create(model="x", prompt="Once upon", max_tokens=8, temperature=0)
    assert c.choices[0].finish_reason in ("length", "stop") and c.usage.completion_tokens <= 8
    streamed = "".join(ch.choices[0].text for ch in client.completions.create(
        model="x", prompt="Once upon", max_tokens=8, temperature=0, stream=True))
    assert streamed == c.choices[0].text
    msgs = [{"role": "user", "content": "Hello"}]
    chat = client.chat.completions.create(model="x", messages=msgs, max_tokens=8, temperature=0)
    parts = [ch.choices[0].delta.content or "" for ch in client.chat.completions.create(
        model="x", messages=msgs, max_tokens=8, temperature=0, stream=True)]
    assert "".join(parts) == chat.choices[0].message.content
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="x", messages=msgs, max_tokens=8, temperature=-1)


def test_eight_concurrent_clients_each_get_their_own_text(server, tiny_engine):
    bodies = [{"prompt": "Once upon", "max_tokens": 16, "temperature": 1.0, "seed": 100 + i} for i in range(8)]
    alone = ["".join(tiny_engine.generate("Once upon", max_tokens=16, temperature=1.0, seed=100 + i))
             for i in range(8)]
    with cf.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda b: execute(server.url, b), bodies))
    assert all(r[-1]["type"] == "end" for r in results)
    assert [text_of(r) for r in results] == alone
    assert len(set(alone)) > 1


def test_cancel_mid_stream_then_same_request_is_unaffected(server, tiny_engine):
    body = {"prompt": "Once upon", "max_tokens": 100, "temperature": 0.8, "seed": 11}
    with httpx.stream("POST", server.url + "/execute", json=body, timeout=60) as r:
        for n, _line in enumerate(r.iter_lines()):
            if n > 6:
                break                                  # the client hangs up mid-stream
    deadline = time.time() + 10
    while httpx.get(server.url + "/health").json()["state"] != "idle" and time.time() < deadline:
        time.sleep(0.05)
    assert httpx.get(server.url + "/health").json()["state"] == "idle"   # generation was cancelled
    full = execute(server.url, body)
    alone = "".join(tiny_engine.generate("Once upon", max_tokens=100, temperature=0.8, seed=11))
    assert text_of(full) == alone


def test_queue_full_is_503_with_retry_after(engine_q41):
    s = LiveServer(engine_q41, max_queue=1)
    try:
        body = {"prompt": "Once upon", "max_tokens": 300}
        with httpx.stream("POST", s.url + "/execute", json=body, timeout=60) as r1:
            lines = r1.iter_lines()                    # held: a discarded httpx line iterator closes the
            next(lines)                                # connection when the GC collects it (the job is cancelled)
            h = httpx.get(s.url + "/health").json()
            assert h["state"] == "busy" and h["queued"] == 1, h   # its slot is held (else say why not)
            r2 = httpx.post(s.url + "/execute", json=body)
            assert r2.status_code == 503 and r2.headers["retry-after"] == "1"
            assert r2.json()["error"]["code"] == "QUEUE_FULL"
    finally:
        s.stop()
