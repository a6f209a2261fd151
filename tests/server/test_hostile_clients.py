"""Hostile clients and values: no ghost work, no stalled event loop, every accepted value safe, OpenAI fields by name.

The slow engine below is the tiny model with a pause after each token (and, when asked, a tokenizer that
waits for a signal), so that "the job stopped when its client left" can be seen; the server, the worker
and the engine's own cancel checks are the real ones."""
from __future__ import annotations

import concurrent.futures as cf
import json
import threading
import time

import httpx
import pytest
from live_server import LiveServer


class SlowEngine:
    """The tiny engine, paced: `delay` seconds after every generated piece; encode_prompt waits on `gate`."""

    def __init__(self, engine, delay=0.05):
        self._e, self.delay = engine, delay
        self.gate = threading.Event()
        self.gate.set()
        self.tokens_made = 0

    def __getattr__(self, name):
        return getattr(self._e, name)

    def encode_prompt(self, *a, **kw):
        assert self.gate.wait(60)
        return self._e.encode_prompt(*a, **kw)

    def generate(self, *a, **kw):
        for piece in self._e.generate(*a, ignore_eos=True, **kw):
            self.tokens_made += 1
            yield piece
            time.sleep(self.delay)


@pytest.fixture()
def slow(tiny_engine):
    eng = SlowEngine(tiny_engine)
    s = LiveServer(eng, max_queue=4)
    s.engine = eng
    yield s
    eng.gate.set()
    s.stop()


def health(s):
    return httpx.get(s.url + "/health", timeout=10).json()


def wait_until(pred, timeout=10.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.02)
    return False


def busy_stream(s, max_tokens=120):
    """Start a long streaming job in a thread; -> (thread, stop event). The job runs until stopped."""
    stop = threading.Event()

    def run():
        with httpx.stream("POST", s.url + "/execute", json={"prompt": "Once", "max_tokens": max_tokens},
                          timeout=60) as r:
            for _ in r.iter_lines():
                if stop.is_set():
                    return
    t = threading.Thread(target=run, daemon=True)
    t.start()
    assert wait_until(lambda: health(s)["state"] == "busy")
    return t, stop


# -- 2. a non-streaming request whose client went away is cancelled, running or queued ------------------
def test_non_streaming_request_is_cancelled_when_the_client_times_out(slow):
    before = slow.engine.tokens_made
    with pytest.raises(httpx.TimeoutException):
        httpx.post(slow.url + "/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 100},
                   timeout=0.5)
    assert wait_until(lambda: health(slow)["state"] == "idle", timeout=10)   # 100 tokens would take 5 s
    made = slow.engine.tokens_made - before
    assert made < 40, made
    assert health(slow)["cancelled"] >= 1


def test_queued_non_streaming_requests_leave_the_queue_when_their_clients_go(slow):
    t, stop = busy_stream(slow)
    with cf.ThreadPoolExecutor(3) as ex:
        futs = [ex.submit(httpx.post, slow.url + "/v1/completions",
                          json={"prompt": "Once", "max_tokens": 50}, timeout=0.5) for _ in range(3)]
        for f in futs:
            with pytest.raises(httpx.TimeoutException):
                f.result()
    # the three queued jobs are gone at once: only the running stream holds a slot
    assert wait_until(lambda: health(slow)["queued"] == 1, timeout=10), health(slow)
    stop.set()
    assert wait_until(lambda: health(slow)["queued"] == 0, timeout=10)


def test_openai_client_timeouts_and_retries_leave_no_work_behind(slow):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=slow.url + "/v1", api_key="x", timeout=0.5, max_retries=2)
    before = health(slow)
    with pytest.raises(openai.APITimeoutError):
        client.completions.create(model="x", prompt="Once upon a time", max_tokens=100)
    assert wait_until(lambda: health(slow)["queued"] == 0 and health(slow)["state"] == "idle", timeout=10)
    after = health(slow)
    assert after["cancelled"] - before["cancelled"] == 3          # three attempts, each stopped
    r = httpx.post(slow.url + "/v1/completions", json={"prompt": "Once", "max_tokens": 3}, timeout=30)
    assert r.status_code == 200                                    # and nobody else gets 503


def test_openai_jobs_can_be_cancelled_by_their_id(slow):
    got = {}

    def call():
        got["r"] = httpx.post(slow.url + "/v1/chat/completions", timeout=60,
                              json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 100})
    t = threading.Thread(target=call)
    t.start()
    assert wait_until(lambda: health(slow)["state"] == "busy")
    job_id = slow.app.state.worker.running.job_id
    assert job_id.startswith("chatcmpl-")
    assert httpx.post(slow.url + "/cancel", json={"job_id": job_id}).status_code == 202
    t.join(10)
    assert got["r"].status_code == 499 and got["r"].headers["x-job-id"] == job_id
    assert httpx.post(slow.url + "/cancel", json={"job_id": job_id}).status_code == 404


# -- 3. a job id that cannot be a header value is refused before anything is queued ---------------------
@pytest.mark.parametrize("job_id", ["x-\U0001F600", "a\r\nX-Evil: 1", "with space", "", "x" * 201])
def test_bad_job_id_is_400_and_makes_no_job(slow, job_id):
    before = health(slow)
    r = httpx.post(slow.url + "/execute", json={"prompt": "Once", "max_tokens": 5, "job_id": job_id})
    assert r.status_code == 400 and "job_id" in r.json()["error"]["fields"]
    time.sleep(0.2)
    after = health(slow)
    assert after["queued"] == 0 and after["served"] == before["served"] and after["state"] == "idle"


def test_duplicate_job_id_is_409(slow):
    t, stop = busy_stream(slow)
    job_id = slow.app.state.worker.running.job_id
    r = httpx.post(slow.url + "/execute", json={"prompt": "Once", "max_tokens": 5, "job_id": job_id})
    assert r.status_code == 409 and r.json()["error"]["code"] == "JOB_ID_IN_USE"
    assert health(slow)["queued"] == 1
    stop.set()


# -- 4. tokenization runs off the event loop, inside the --max-queue bound -----------------------------
def test_health_answers_while_a_prompt_is_being_tokenized(slow):
    slow.engine.gate.clear()                       # every tokenization now waits
    with cf.ThreadPoolExecutor(2) as ex:
        fut = ex.submit(httpx.post, slow.url + "/execute", json={"prompt": "Once", "max_tokens": 2}, timeout=60)
        assert wait_until(lambda: health(slow)["queued"] == 1)      # admitted, tokenizing
        assert health(slow)["status"] == "healthy"                 # the loop is free meanwhile
        slow.engine.gate.set()
        assert fut.result().status_code == 200


def test_max_queue_bounds_prompts_being_tokenized(slow):
    slow.engine.gate.clear()
    with cf.ThreadPoolExecutor(5) as ex:
        futs = [ex.submit(httpx.post, slow.url + "/execute", json={"prompt": "Once", "max_tokens": 2}, timeout=60)
                for _ in range(4)]
        assert wait_until(lambda: health(slow)["queued"] == 4)
        r = httpx.post(slow.url + "/execute", json={"prompt": "Once", "max_tokens": 2}, timeout=10)
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        slow.engine.gate.set()
        assert all(f.result().status_code == 200 for f in futs)


def test_a_1mb_prompt_is_refused_without_holding_a_slot(slow):
    big = "word " * 200_000                         # ~1 MB, over the context: 400 after tokenizing off the loop
    r = httpx.post(slow.url + "/v1/completions", json={"prompt": big[: (1 << 20) - 100]}, timeout=60)
    assert r.status_code == 400 and "prompt" in r.json()["error"]["fields"]
    assert health(slow)["queued"] == 0


# -- 5. every value that validation accepts is numerically safe ----------------------------------------
@pytest.mark.parametrize("field,value", [("temperature", 1e-38), ("temperature", 5e-324),
                                         ("repetition_penalty", 1e-38), ("repetition_penalty", 5e-324)])
def test_tiny_temperature_and_penalty_give_real_tokens(server, tiny_engine, field, value):
    body = {"prompt": "Once upon", "max_tokens": 8, "seed": 1, field: value}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    text = r.json()["choices"][0]["text"]
    if field == "temperature":                     # all the mass on the top token: the greedy text
        assert text == "".join(tiny_engine.generate("Once upon", max_tokens=8))
    ids = tiny_engine.tokenizer.encode(text) if text else []
    assert tiny_engine.config.n_vocab - 1 not in ids or len(set(ids)) > 1   # not the last id over and over


# -- strict types and OpenAI fields ------------------------------------------------------------------
@pytest.mark.parametrize("body,field", [({"prompt": "hi", "max_tokens": "2"}, "max_tokens"),
                                        ({"prompt": "hi", "temperature": True}, "temperature"),
                                        ({"prompt": "hi", "seed": 1.0}, "seed"),
                                        ({"prompt": "hi", "stream": 1}, "stream")])
def test_values_are_not_coerced(server, body, field):
    r = httpx.post(server.url + "/v1/completions", json=body)
    assert r.status_code == 400 and field in r.json()["error"]["fields"], r.text


@pytest.mark.parametrize("extra", [{"tools": [{"type": "function", "function": {"name": "f"}}]},
                                   {"top_logprobs": 2}, {"response_format": {"type": "json_object"}},
                                   {"metadata": {"a": "b"}}, {"stream_options": {"include_usage": True}}])
def test_openai_fields_not_implemented_are_refused_by_name(server, extra):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra}
    r = httpx.post(server.url + "/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert list(extra)[0] in err["message"], err


def test_openai_fields_the_official_client_sends_are_applied(server, tiny_engine):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    msgs = [{"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Once "}, {"type": "text", "text": "upon"}]}]
    ref = "".join(tiny_engine.generate(messages=[{"role": "system", "content": "Be brief."},
                                                 {"role": "user", "content": "Once upon"}], max_tokens=6))
    c = client.chat.completions.create(model="x", messages=msgs, max_completion_tokens=6, temperature=0)
    assert c.choices[0].message.content == ref and c.usage.completion_tokens <= 6
    chunks = list(client.chat.completions.create(model="x", messages=msgs, max_completion_tokens=6, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == c.usage.completion_tokens
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks[:-1]) == ref
    with pytest.raises(openai.BadRequestError, match="image_url"):
        client.chat.completions.create(model="x", max_tokens=2, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}])


def test_whitespace_prompt_is_400(server):
    r = httpx.post(server.url + "/execute", json={"prompt": "   \n\t "})
    assert r.status_code == 400 and "whitespace" in r.json()["error"]["fields"]["prompt"]


def test_auth_runs_before_the_body_and_sees_disconnects(tiny_engine):
    with pytest.raises(ValueError):
        from llorch_ref.server.app import create_app
        create_app(tiny_engine, api_token="")
    eng = SlowEngine(tiny_engine)
    s = LiveServer(eng, api_token="s3cret")
    try:
        r = httpx.post(s.url + "/execute", content=b"x" * (2 << 20), headers={"content-type": "text/plain"})
        assert r.status_code == 401                                   # not 413/415: no body read for strangers
        auth = {"Authorization": "Bearer s3cret"}
        before = eng.tokens_made
        with pytest.raises(httpx.TimeoutException):
            httpx.post(s.url + "/v1/completions", json={"prompt": "Once", "max_tokens": 100}, headers=auth,
                       timeout=0.5)
        assert wait_until(lambda: httpx.get(s.url + "/health").json()["state"] == "idle", timeout=10)
        assert eng.tokens_made - before < 40
    finally:
        s.stop()


def test_sse_stream_lines_are_json(server):
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                      json={"prompt": "Once", "max_tokens": 3, "stream": True}) as r:
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and all(json.loads(ln[6:]) for ln in lines[:-1])
