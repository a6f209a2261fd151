"""Bodies the JSON parser refuses (nesting deeper than it recurses, an integer of thousands of digits), numbers
past float64, unknown routes and methods, a hostile chat template, and the bearer scheme in any case: every
answer has the documented error shape {"error": {"code", "message"[, "fields"]}}, never FastAPI's {"detail"}."""
from __future__ import annotations

import httpx
import pytest
from live_server import LiveServer

JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def bserver(tiny_engine):
    s = LiveServer(tiny_engine, max_queue=4)
    yield s
    s.stop()


def documented(r, status, code):
    body = r.json()
    assert r.status_code == status and set(body) == {"error"}, (r.status_code, r.text[:300])
    assert body["error"]["code"] == code and isinstance(body["error"]["message"], str), body
    return body["error"]


@pytest.mark.parametrize("body,fragment", [
    (b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nest"),
    (b"[" * 5000 + b"]" * 5000, "nest"),
    (b'{"prompt": ' + b"[" * 900 + b"]" * 900 + b"}", "prompt"),
    (b'{"prompt": "hi", "seed": ' + b"1" * 5000 + b"}", "digits"),
    (b'{"prompt": "hi", "max_tokens": ' + b"9" * 100_000 + b"}", "digits"),
])
def test_bodies_the_parser_refuses_get_the_error_shape(bserver, body, fragment):
    err = documented(httpx.post(bserver.url + "/execute", content=body, headers=JSON), 400, "INVALID_REQUEST")
    assert fragment in err["message"], err
    assert httpx.get(bserver.url + "/health").json()["status"] == "healthy"


@pytest.mark.parametrize("body", [b'{"prompt": "hi", "temperature": 1e5000}', b'{"prompt": "hi", "top_p": -1e5000}',
                                  b'{"prompt": "hi", "max_tokens": 1e5000}', b"1e5000",
                                  b'{"prompt": "hi", "temperature": NaN}'])
def test_numbers_past_float64_get_the_error_shape(bserver, body):
    documented(httpx.post(bserver.url + "/execute", content=body, headers=JSON), 400, "INVALID_REQUEST")


@pytest.mark.parametrize("method,path,status,code", [("GET", "/nowhere", 404, "NOT_FOUND"),
                                                     ("GET", "/execute", 405, "METHOD_NOT_ALLOWED")])
def test_unknown_routes_and_methods_get_the_error_shape(bserver, method, path, status, code):
    documented(httpx.request(method, bserver.url + path), status, code)


@pytest.fixture(scope="module")
def tserver(tiny_engine):
    s = LiveServer(tiny_engine, api_token="s3cret")
    yield s
    s.stop()


@pytest.mark.parametrize("header", ["Bearer s3cret", "bearer s3cret", "BEARER s3cret", "bEaReR s3cret",
                                    "Bearer   s3cret"])
def test_the_bearer_scheme_is_case_insensitive(tserver, header):
    assert httpx.get(tserver.url + "/v1/models", headers={"Authorization": header}).status_code == 200


@pytest.mark.parametrize("header,code", [("bearer wrong", "INVALID_API_KEY"), ("bearer s3cre", "INVALID_API_KEY"),
                                         ("Basic s3cret", "MISSING_API_KEY"), ("bearer", "MISSING_API_KEY"),
                                         ("Bearers3cret", "MISSING_API_KEY"), ("", "MISSING_API_KEY")])
def test_a_wrong_token_in_any_case_is_still_401(tserver, header, code):
    documented(httpx.get(tserver.url + "/v1/models", headers={"Authorization": header}), 401, code)


@pytest.fixture(scope="module")
def hostile_template_engine(tmp_path_factory):
    import llorch_ref
    from llorch_ref.testing import tiny as tiny_mod

    saved = tiny_mod.CHAT_TEMPLATE
    tiny_mod.CHAT_TEMPLATE = "{{ 'x' * 10**13 }}"
    try:
        path = tiny_mod.write_tiny_model(tmp_path_factory.mktemp("hostile") / "t.gguf", vocab="bpe")
    finally:
        tiny_mod.CHAT_TEMPLATE = saved
    return llorch_ref.load(path)


def test_a_hostile_chat_template_is_400_in_the_error_shape(hostile_template_engine):
    s = LiveServer(hostile_template_engine)
    try:
        r = httpx.post(s.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                             "max_tokens": 1}, timeout=30)
        err = documented(r, 400, "INVALID_REQUEST")
        assert "chat template" in err["fields"]["messages"], err
        assert httpx.get(s.url + "/health").json()["status"] == "healthy"
    finally:
        s.stop()
