"""OpenAI log-probabilities on both routes of the server (a tiny model on loopback): the shapes OpenAI gives, the
figures the model's own teacher-forced forward gives (recomputed here from engine.logits), and every hostile
value refused in the documented shape with the server healthy afterwards."""
from __future__ import annotations

import httpx
import numpy as np
import pytest

PROMPT = "Once upon"


def logp_of(engine, prompt_ids, tokens):
    """The distributions the tokens were drawn from, by numpy from the engine's logits (float64 log-softmax)."""
    x = engine.logits(list(prompt_ids) + list(tokens[:-1]))[len(prompt_ids) - 1:].astype(np.float64)
    return x - x.max(axis=1, keepdims=True) - np.log(np.exp(x - x.max(axis=1, keepdims=True)).sum(axis=1,
                                                                                                 keepdims=True))


def text_of(engine, i):
    return engine.tokenizer.token_bytes(i).decode("utf-8", errors="ignore")


def post(server, route, body):
    return httpx.post(server.url + route, json=body, timeout=120)


def test_completions_logprobs_are_the_models_in_openais_shape(server, tiny_engine):
    r = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 5, "temperature": 0, "logprobs": 3})
    assert r.status_code == 200, r.text
    ch = r.json()["choices"][0]
    lp = ch["logprobs"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    ids = tiny_engine.tokenizer.encode(PROMPT)
    gen = list(tiny_engine.generate_ids(ids, max_tokens=5))
    ref = logp_of(tiny_engine, ids, gen)
    assert lp["tokens"] == [text_of(tiny_engine, t) for t in gen]
    assert np.allclose(lp["token_logprobs"], [ref[j, t] for j, t in enumerate(gen)], atol=1e-9)
    for j, top in enumerate(lp["top_logprobs"]):
        best = np.argsort(-ref[j])[:3]
        want = {text_of(tiny_engine, int(i)): ref[j, i] for i in best}
        assert set(want) <= set(top) and len(top) <= 4                 # the top 3, and the chosen token
        assert all(abs(top[k] - v) < 1e-9 for k, v in want.items())
    assert lp["text_offset"][0] == len(PROMPT)
    assert np.diff(lp["text_offset"]).tolist() == [len(t) for t in lp["tokens"][:-1]]


def test_chat_logprobs_are_the_models_in_openais_shape(server, tiny_engine):
    msgs = [{"role": "user", "content": PROMPT}]
    r = post(server, "/v1/chat/completions", {"messages": msgs, "max_tokens": 4, "temperature": 0,
                                               "logprobs": True, "top_logprobs": 2})
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    assert set(lp) == {"content", "refusal"} and lp["refusal"] is None
    ids = tiny_engine.encode_prompt(messages=msgs)
    gen = list(tiny_engine.generate_ids(ids, max_tokens=4))
    ref = logp_of(tiny_engine, ids, gen)
    assert len(lp["content"]) == len(gen)
    for j, (c, t) in enumerate(zip(lp["content"], gen)):
        assert bytes(c["bytes"]) == tiny_engine.tokenizer.token_bytes(t) and abs(c["logprob"] - ref[j, t]) < 1e-9
        assert [e["bytes"] for e in c["top_logprobs"]] == [list(tiny_engine.tokenizer.token_bytes(int(i)))
                                                           for i in np.argsort(-ref[j], kind="stable")[:2]]


def test_the_whole_vocabulary_sums_to_one(server, tiny_engine):
    n = tiny_engine.config.n_vocab
    msgs = [{"role": "user", "content": PROMPT}]
    r = post(server, "/v1/chat/completions", {"messages": msgs, "max_tokens": 2, "temperature": 0,
                                               "logprobs": True, "top_logprobs": n})
    content = r.json()["choices"][0]["logprobs"]["content"]
    for c in content:
        assert len(c["top_logprobs"]) == n
        assert abs(sum(np.exp(e["logprob"]) for e in c["top_logprobs"]) - 1) < 1e-9
    r = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "temperature": 0, "logprobs": n})
    texts = {text_of(tiny_engine, i) for i in range(n)}
    assert all(set(top) == texts for top in r.json()["choices"][0]["logprobs"]["top_logprobs"])


def test_no_logprobs_asked_gives_null(server):
    r = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "logprobs": False})
    assert r.status_code == 200 and r.json()["choices"][0]["logprobs"] is None
    r = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert r.json()["choices"][0]["logprobs"] is None


def test_tokenize_route_gives_the_ids_the_prompt_runs_on(server, tiny_engine):
    r = post(server, "/tokenize", {"content": PROMPT})
    assert r.json() == {"tokens": tiny_engine.tokenizer.encode(PROMPT)}
    assert post(server, "/tokenize", {"content": PROMPT, "x": 1}).status_code == 400


def test_repeat_penalty_is_llama_cpp_pythons_name_of_repetition_penalty(server):
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0}
    a = post(server, "/v1/completions", {**body, "repeat_penalty": 1.3}).json()["choices"][0]["text"]
    b = post(server, "/v1/completions", {**body, "repetition_penalty": 1.3}).json()["choices"][0]["text"]
    assert a == b
    r = post(server, "/v1/completions", {**body, "repeat_penalty": 1.3, "repetition_penalty": 1.1})
    assert r.status_code == 400 and "differ" in r.text


CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
HOSTILE = [
    ("/v1/completions", {"logprobs": -1}, "logprobs", "greater than or equal to 0"),
    ("/v1/completions", {"logprobs": True}, "logprobs", "an integer"),
    ("/v1/completions", {"logprobs": "3"}, "logprobs", ""),
    ("/v1/completions", {"logprobs": 1.5}, "logprobs", ""),
    ("/v1/completions", {"logprobs": 10 ** 30}, "logprobs", "the vocabulary"),
    ("/v1/completions", {"logprobs": 2, "stream": True}, "logprobs", "non-streaming"),
    ("/v1/chat/completions", {"top_logprobs": 3}, "top_logprobs", "only allowed with logprobs: true"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": -2}, "top_logprobs", "greater than or equal to 0"),
    ("/v1/chat/completions", {"logprobs": 1}, "logprobs", ""),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 10 ** 9}, "top_logprobs", "the vocabulary"),
]


@pytest.mark.parametrize("route, extra, field, says", HOSTILE)
def test_hostile_logprob_values_are_400_in_the_documented_shape(server, route, extra, field, says):
    body = {**(CHAT if "chat" in route else {"prompt": "hi", "max_tokens": 2}), **extra}
    r = post(server, route, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "INVALID_REQUEST" and field in err["fields"] and says in err["fields"][field], err
    assert httpx.get(server.url + "/health").json()["status"] == "healthy"


def test_a_response_past_the_entry_limit_is_refused_before_any_work(server, tiny_engine):
    from llorch_ref.server.logprobs import MAX_ENTRIES

    n = tiny_engine.config.n_vocab
    steps = MAX_ENTRIES // (n + 1) + 1
    served = httpx.get(server.url + "/health").json()["served"]
    r = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": steps, "logprobs": n})
    assert r.status_code == 400 and f"at most {steps - 1} tokens" in r.json()["error"]["fields"]["logprobs"]
    assert httpx.get(server.url + "/health").json()["served"] == served          # nothing was queued


def test_echo_gives_every_prompt_token_its_distribution(server, tiny_engine):
    r = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "temperature": 0, "logprobs": 1,
                                         "echo": True})
    ch = r.json()["choices"][0]
    lp = ch["logprobs"]
    ids = tiny_engine.tokenizer.encode(PROMPT)
    gen = list(tiny_engine.generate_ids(ids, max_tokens=2))
    ref = logp_of(tiny_engine, ids[:1], ids[1:] + gen)             # every token after the first, teacher-forced
    assert ch["text"].startswith(PROMPT) and lp["tokens"] == [text_of(tiny_engine, t) for t in ids + gen]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None and lp["text_offset"][0] == 0
    assert np.allclose(lp["token_logprobs"][1:], [ref[j, t] for j, t in enumerate(ids[1:] + gen)], atol=1e-9)


def test_echo_with_stream_is_refused(server):
    r = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1, "logprobs": 2, "echo": True,
                                         "stream": True})
    assert r.status_code == 400 and "echo" in r.json()["error"]["fields"]


def test_the_prompt_bounds_follow_the_forward_and_the_response():
    from llorch_ref.server.logprobs import FORWARD_VALUES, MAX_ENTRIES, prompt_error

    v = 49152
    most = FORWARD_VALUES // v
    assert prompt_error(20, most - 1, 1, v, echo=False) is None
    assert f"at most {most} tokens" in prompt_error(20, most, 1, v, echo=False)
    assert prompt_error(v, 30, 1, v, echo=False) is None
    assert f"over the {MAX_ENTRIES}" in prompt_error(v, 30, 1, v, echo=True)
