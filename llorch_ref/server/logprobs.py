"""OpenAI log-probabilities of a finished generation: the reference run teacher-forced on the prompt and the
tokens it chose (one forward over them, what `llorch-ref diff --subject openai:URL` runs on its side, so that
the reference against itself gives KLD exactly 0), in float64, before temperature and penalties; and their JSON
in OpenAI's shapes, written as text (a whole vocabulary a step is millions of entries: no dict per entry).

- /v1/completions (`logprobs: K`): choices[0].logprobs = {tokens, token_logprobs, top_logprobs (text ->
  logprob: the top K and the chosen token, a text several tokens share kept once, at its likeliest),
  text_offset}; a token's text is its bytes decoded as UTF-8, undecodable bytes dropped. With `echo: true` the
  prompt's tokens come first, each with the distribution it is drawn from after the tokens before it (the first
  with nulls): a corpus scored in one request.
- /v1/chat/completions (`logprobs: true`, `top_logprobs: K`): choices[0].logprobs = {content: [{token,
  logprob, bytes, top_logprobs: [{token, logprob, bytes}] (the top K)}], refusal: null}.

A request may ask for at most MAX_ENTRIES entries (max_tokens x (K + 1), with echo the prompt's tokens too): the
whole vocabulary of the default model for 21 tokens; and prompt and max_tokens together at most FORWARD_VALUES /
V tokens (682 on the default model).
"""
from __future__ import annotations

import json

import numpy as np

MAX_ENTRIES = 1 << 20          # log-probabilities one response may carry: max_tokens x (K + 1)
FORWARD_VALUES = 1 << 25       # the forward's logits: (prompt + max_tokens) x V values at most (256 MiB float64)
FLOOR = -9999.0                # a log-probability of -inf is written as OpenAI writes it


def bounds_error(k: int | None, max_tokens: int, n_vocab: int, stream: bool) -> str | None:
    """Why a request for k top log-probabilities a step over max_tokens tokens is refused, or None."""
    if k is None:
        return None
    if stream:
        return "log-probabilities are given on non-streaming requests only (send stream: false)"
    if k > n_vocab:
        return f"must be in 0..{n_vocab} (the vocabulary), got {k}"
    if max_tokens * (k + 1) > MAX_ENTRIES:
        return (f"max_tokens {max_tokens} x ({k} + 1) log-probabilities is over the {MAX_ENTRIES} a response may "
                f"carry: ask for at most {MAX_ENTRIES // (k + 1)} tokens with this many")
    return None


def prompt_error(k: int, n_prompt: int, max_tokens: int, n_vocab: int, echo: bool) -> str | None:
    """Why log-probabilities over a prompt of n_prompt tokens are refused, or None: the forward's logits (at most
    FORWARD_VALUES values: every position's distribution is made) and, with echo, the response's entries."""
    n = n_prompt + max_tokens
    if n * n_vocab > FORWARD_VALUES:
        return (f"{n_prompt} prompt tokens and max_tokens {max_tokens}: log-probabilities take at most "
                f"{FORWARD_VALUES // n_vocab} tokens in all (the distribution of every position is made)")
    if echo and n * (k + 1) > MAX_ENTRIES:
        return (f"{n_prompt} prompt tokens and max_tokens {max_tokens} x ({k} + 1) log-probabilities is over the "
                f"{MAX_ENTRIES} a response may carry")
    return None


def log_softmax64(logits) -> np.ndarray:
    """log softmax of each row, in float64 (the harness's formula, operation for operation: the same bits)."""
    x = np.asarray(logits, dtype=np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def teacher_forced(engine, prompt_ids: list, token_ids: list, echo: bool = False) -> np.ndarray:
    """[len(token_ids), V] float64: the distribution each chosen token was drawn from, by one forward over the
    prompt and the tokens but the last; echo: [len(prompt_ids) - 1 + len(token_ids), V], the prompt's tokens from
    the second on too. Every row's logits are made, as the harness makes them: a product of fewer rows takes
    other paths through BLAS (2.7e-5 apart for one row on the default model, 5e-7 for four on a tiny one), so
    FORWARD_VALUES bounds the request."""
    fed = list(prompt_ids) + list(token_ids[:-1])
    return log_softmax64(engine.logits(fed)[0 if echo else len(prompt_ids) - 1:])


class TokenJSON:
    """Every token's text and JSON pieces for one vocabulary, made once: its text (UTF-8, undecodable bytes
    dropped), that text as a JSON string, and its bytes as a JSON list."""

    def __init__(self, tokenizer):
        raw = [tokenizer.token_bytes(i) for i in range(tokenizer.n_vocab)]
        self.text = [b.decode("utf-8", errors="ignore") for b in raw]
        self.quoted = [json.dumps(t, ensure_ascii=False) for t in self.text]
        self.bytes = ["[" + ",".join(map(str, b)) + "]" for b in raw]
        self.n_vocab = len(raw)


def _num(v: float) -> str:
    return repr(float(v)) if np.isfinite(v) else repr(FLOOR)


def _top(row: np.ndarray, k: int) -> np.ndarray:
    """The ids of the k likeliest entries, likeliest first (ties: the lower id first)."""
    if k <= 0:
        return np.empty(0, dtype=np.int64)
    if k >= row.shape[0]:
        return np.argsort(-row, kind="stable")
    part = np.argpartition(-row, k - 1)[:k]
    return part[np.lexsort((part, -row[part]))]


def completion_json(logp: np.ndarray, tokens: list, k: int, tj: TokenJSON, offset0: int, echo_first=None) -> str:
    """choices[0].logprobs of /v1/completions as JSON text; text_offset counts characters from offset0 (the
    prompt's length: offsets are into prompt + completion). echo_first: the prompt's first token, echoed with
    null log-probabilities (nothing precedes it), before `tokens` (the rest of the prompt and the completion)."""
    texts, lps, tops, offsets = [], [], [], []
    at = offset0
    if echo_first is not None:
        texts.append(tj.quoted[echo_first])
        lps.append("null")
        tops.append("null")
        offsets.append(str(at))
        at += len(tj.text[echo_first])
    for j, t in enumerate(tokens):
        row = logp[j]
        texts.append(tj.quoted[t])
        lps.append(_num(row[t]))
        offsets.append(str(at))
        at += len(tj.text[t])
        seen, parts = set(), []
        for i in [*_top(row, k).tolist(), t]:
            s = tj.text[i]
            if s not in seen:
                seen.add(s)
                parts.append(f"{tj.quoted[i]}: {_num(row[i])}")
        tops.append("{" + ", ".join(parts) + "}")
    return (f'{{"tokens": [{", ".join(texts)}], "token_logprobs": [{", ".join(lps)}], '
            f'"top_logprobs": [{", ".join(tops)}], "text_offset": [{", ".join(offsets)}]}}')


def _entry(tj: TokenJSON, i: int, v: float) -> str:
    return f'{{"token": {tj.quoted[i]}, "logprob": {_num(v)}, "bytes": {tj.bytes[i]}}}'


def chat_json(logp: np.ndarray, tokens: list, k: int, tj: TokenJSON) -> str:
    """choices[0].logprobs of /v1/chat/completions as JSON text."""
    content = []
    for j, t in enumerate(tokens):
        row = logp[j]
        top = ", ".join(_entry(tj, i, row[i]) for i in _top(row, k).tolist())
        content.append(f'{{"token": {tj.quoted[t]}, "logprob": {_num(row[t])}, "bytes": {tj.bytes[t]}, '
                       f'"top_logprobs": [{top}]}}')
    return f'{{"content": [{", ".join(content)}], "refusal": null}}'
