"""Corpus statistics of a black-box engine (`eval --subject openai:URL|mistralrs`): each chunk's scored positions'
distributions from what the engine serves, scored against the reference under llama-perplexity's names
(harness/kld.py's ChunkScores, so summary() and every page are the same as for an engine with logits).

How the distributions are had, the first that works:
- echo: one /v1/completions request a chunk with `echo: true`, `max_tokens: 1` and `logprobs: K`: the prompt's
  own tokens with their log-probabilities. OpenAI's layout gives entry i the distribution token i was drawn from
  (the answer holds the prompt's tokens and the one generated); llama-cpp-python's gives entry i the distribution
  after token i (the answer holds the prompt's tokens only): both read by that count.
- prefix: one request a scored position, the chunk's text up to it, one greedy token with its K log-probabilities
  (a server with a prefix cache computes the new token only); mistral.rs always so (one model loaded), by default
  with the whole vocabulary. A chunk with a scored prefix whose text the reference's tokenizer, or the server's
  tokenize route, gives back as other ids is left out (counted), so that every chunk scores the same positions.

Per scored position: KLD exact over the vocabulary, or with the top K the lower bound of harness/blackbox.kld_step
(the rest lumped); -log q(target) exact where the engine lists the target, else -log(its unlisted mass), a lower
bound (counted as `nll_bounded`); the subject's top tokens from its listed entries. What it cost is said: requests
and seconds.
"""
from __future__ import annotations

import time

import numpy as np

from ..errors import BlackBoxError
from ..references.blackbox import (
    RAW_TEMPLATE,
    openai_trace,
    parse_chat,
    piece_index,
    post,
    token_of,
)
from .blackbox import kld_step, log_softmax64
from .kld import TOP_K, ChunkScores


def chunk_text(tok, ids) -> str:
    return b"".join(tok.token_bytes(int(i)) for i in ids).decode("utf-8", errors="ignore")


def prefixes_round_trip(tok, c) -> bool:
    """Every scored position's prefix of chunk c tokenizes back from its text to the same ids ('\n' '\n' is not
    '\n\n')."""
    return all(tok.encode(chunk_text(tok, c[:e])) == list(c[:e]) for e in range(len(c) // 2 + 1, len(c) + 1))


def round_trips(tok, chunks, n: int | None = None, prefixes: bool = False) -> tuple[list, int]:
    """-> (the first n chunks (None: all) whose text (with prefixes: and every scored prefix's, prefixes_round_trip)
    the reference's tokenizer gives back as the same ids; how many were left out on the way): a black box is sent
    text, so a chunk cut where its text tokenizes otherwise cannot be asked for."""
    kept, left = [], 0
    for c in chunks:
        if n is not None and len(kept) == n:
            break
        if tok.encode(chunk_text(tok, c)) == list(c) and (not prefixes or prefixes_round_trip(tok, c)):
            kept.append(c)
        else:
            left += 1
    return kept, left


def position_scores(ref_row: np.ndarray, top: dict, target: int, target_lp: float | None) -> dict:
    """One scored position's figures from the engine's listed entries (id -> logprob) and the reference's
    log-probabilities: kld (exact or bound), nll (exact or bounded), p_diff, same_top, ref_top_in."""
    kld, how, _ = kld_step(ref_row, top)
    listed = np.fromiter(top.values(), dtype=np.float64, count=len(top))
    if target_lp is None:
        target_lp = top.get(target)
    bounded = target_lp is None
    if bounded:                                  # q(target) <= the unlisted mass
        target_lp = float(np.log(max(1.0 - float(np.exp(listed).sum()), 1e-300)))
    order = sorted(top, key=lambda i: -top[i])
    ref_top = int(np.argmax(ref_row))
    return {"kld": kld, "kind": how, "nll": -float(target_lp), "nll_base": -float(ref_row[target]),
            "p_diff": float(np.exp(target_lp) - np.exp(ref_row[target])), "same_top": bool(order and order[0] == ref_top),
            "ref_top_in": {k: ref_top in order[:k] for k in TOP_K}, "bounded": bounded}


def chunk_scores(index: int, per: list[dict]) -> ChunkScores:
    a = lambda k: np.array([p[k] for p in per], dtype=np.float64)       # noqa: E731
    return ChunkScores(index, a("nll"), a("nll_base"), a("kld"), a("p_diff"), np.array([p["same_top"] for p in per]),
                       {k: np.array([p["ref_top_in"][k] for p in per]) for k in TOP_K})


class Cost:
    """What the engine was asked: requests, seconds waiting for it, positions left out and bounded figures."""

    def __init__(self):
        self.requests, self.engine_s, self.skipped, self.bounded, self.bound_kld, self.tokenize = 0, 0.0, 0, 0, 0, 0
        self.echo_refused, self.chunks_dropped = None, 0

    def timed(self, fn, *a, **kw):
        t0 = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            self.requests += 1
            self.engine_s += time.perf_counter() - t0


# -- OpenAI-compatible servers ----------------------------------------------------------------------------------
def echo_positions(url, tok, ids, top_k, timeout, cost) -> list[tuple[dict, float | None]] | None:
    """The chunk's scored positions through one echo request: [(id -> logprob, the target's logprob or None)] for
    positions first..len-2, or None where the server gives no echo with log-probabilities."""
    body = {"prompt": chunk_text(tok, ids), "max_tokens": 1, "temperature": 0.0, "echo": True, "logprobs": top_k,
            "stream": False}
    try:
        out = cost.timed(post, url, "/v1/completions", body, timeout)
        lp = out["choices"][0]["logprobs"]
        tokens, tops, lps = lp["tokens"], lp["top_logprobs"], lp["token_logprobs"]
    except BlackBoxError as e:
        if "HTTP 4" in str(e):
            cost.echo_refused = str(e)[:300]
            return None
        raise
    except (KeyError, IndexError, TypeError):
        cost.echo_refused = "the answer has no logprobs of the prompt's tokens"
        return None
    n = len(ids)
    if len(tokens) not in (n, n + 1) or len(tops) != len(tokens):
        return None
    index, shared = piece_index(tok)
    for i, (t, want) in enumerate(zip(tokens[:n], ids)):
        got = token_of(str(t), index, shared, f"{url} echo position {i}")
        if got is not None and got != int(want):
            raise BlackBoxError(f"{url}: the server tokenized the chunk otherwise at position {i} (token {t!r}, the "
                                f"reference's {tok.token_bytes(int(want))!r})")
    openai_layout = len(tokens) == n + 1       # entry i: the distribution token i was drawn from
    first = n // 2
    out_pos = []
    for j in range(first, n - 1):
        k = j + 1 if openai_layout else j
        top = {}
        for text, v in (tops[k] or {}).items():
            i = token_of(str(text), index, shared, f"{url} echo position {k}")
            if i is not None:
                top[i] = float(v)
        target_lp = lps[j + 1] if openai_layout and lps[j + 1] is not None else None
        out_pos.append((top, None if target_lp is None else float(target_lp)))
    return out_pos


def prefix_positions(url, tok, ids, top_k, timeout, cost) -> list[tuple[dict, float | None] | None]:
    """One one-token request per scored position; None for a position whose prefix the server tokenizes otherwise
    (through its tokenize route)."""
    n, out = len(ids), []
    for j in range(n // 2, n - 1):
        tr = cost.timed(openai_trace, url, chunk_text(tok, ids[:j + 1]), tok, n_steps=1, top_k=top_k,
                        timeout=timeout)
        cost.tokenize += 1 if tr.tokenized_by else 0      # the tokenize route's own request
        if tr.prompt_ids is not None and [int(t) for t in tr.prompt_ids] != [int(t) for t in ids[:j + 1]]:
            out.append(None)
            continue
        out.append((tr.steps[0].top, None))
    return out


# -- mistral.rs -------------------------------------------------------------------------------------------------
class MistralrsPrefix:
    """mistral.rs loaded once on the GGUF file, asked one greedy token with the whole vocabulary per prefix."""

    def __init__(self, model_path, tok, workdir, top_k: int):
        try:
            import mistralrs
        except ImportError:
            raise BlackBoxError("--subject mistralrs needs the mistralrs wheel (pip install mistralrs, or the "
                                "'blackbox' extra)") from None
        from pathlib import Path

        self.m, self.tok, self.top_k = mistralrs, tok, top_k
        path = Path(model_path).resolve()
        tpl = Path(workdir) / "raw.jinja"
        tpl.write_text(RAW_TEMPLATE)
        try:
            self.runner = mistralrs.Runner(which=mistralrs.Which.GGUF(quantized_model_id=str(path.parent),
                                                                      quantized_filename=path.name),
                                           jinja_explicit=str(tpl))
        except Exception as e:             # the wheel raises its own types
            raise BlackBoxError(f"mistral.rs on {path.name}: {type(e).__name__}: {str(e).splitlines()[0][:200]}") \
                from None

    def positions(self, ids, cost) -> list:
        n, out = len(ids), []
        for j in range(n // 2, n - 1):
            req = self.m.ChatCompletionRequest(model="default", messages=[{"role": "user", "content": chunk_text(
                self.tok, ids[:j + 1])}], max_tokens=1, temperature=0.0, logprobs=True,
                top_logprobs=self.top_k)
            try:
                res = cost.timed(self.runner.send_chat_completion_request, req)
            except Exception as e:
                raise BlackBoxError(f"mistral.rs: {type(e).__name__}: {str(e).splitlines()[0][:200]}") from None
            if getattr(res.usage, "prompt_tokens", j + 1) != j + 1:
                out.append(None)
                continue
            out.append((parse_chat(res.choices[0].logprobs.content, self.tok, self.top_k, "mistral.rs",
                                   ids=True)[0].top, None))
        return out


# -- the whole run ----------------------------------------------------------------------------------------------
def run_blackbox_eval(subject: str, engine, chunks, top_k: int | None, timeout: float, workdir, progress=None):
    """-> (ChunkScores by chunk, {"method", "requests", "tokenize_requests", "engine_s", "reference_s", "positions",
    "skipped_positions", "nll_bounded", "kld", "top_k"}). subject: "openai:URL" or "mistralrs" (on engine.path); engine: the reference."""
    tok, cost, method = engine.tokenizer, Cost(), None
    k = top_k or (tok.n_vocab if subject == "mistralrs" else 20)
    mrs = MistralrsPrefix(engine.path, tok, workdir, k) if subject == "mistralrs" else None
    url = None if mrs else subject[len("openai:"):]
    scores, ref_s, n_pos = [], 0.0, 0
    for ci, ids in enumerate(chunks):
        if (mrs or method == "prefix") and not prefixes_round_trip(tok, ids):
            cost.chunks_dropped += 1           # a prefix the engine would be sent as other tokens
            continue
        if mrs:
            pos, method = mrs.positions(ids, cost), "prefix"
        else:
            pos = echo_positions(url, tok, ids, k, timeout, cost) if method in (None, "echo") else None
            method = method or ("echo" if pos is not None else "prefix")
            if pos is None:
                if not prefixes_round_trip(tok, ids):
                    cost.chunks_dropped += 1
                    continue
                pos = prefix_positions(url, tok, ids, k, timeout, cost)
        t0 = time.perf_counter()
        first = len(ids) // 2
        ref = log_softmax64(engine.logits(list(ids))[first:-1])
        per = []
        if any(p is None for p in pos):        # every chunk scores the same positions (KLD by position)
            cost.skipped += sum(p is None for p in pos)
            cost.chunks_dropped += 1
            pos = []
        for j, p in enumerate(pos):
            s = position_scores(ref[j], p[0], int(ids[first + j + 1]), p[1])
            cost.bounded += s["bounded"]
            cost.bound_kld += s["kind"] == "bound"
            per.append(s)
        ref_s += time.perf_counter() - t0
        n_pos += len(per)
        if per:
            scores.append(chunk_scores(ci, per))
        if progress:
            progress(len(ids))
    if not scores:
        raise BlackBoxError(f"{subject}: no scored position could be asked for ({cost.skipped} left out: the engine "
                            f"tokenizes every prefix otherwise)")
    whole = k >= tok.n_vocab and not cost.bound_kld
    return scores, {"method": method, "requests": cost.requests, "tokenize_requests": cost.tokenize,
                    "engine_s": cost.engine_s, "reference_s": ref_s, "positions": n_pos,
                    "skipped_positions": cost.skipped, "chunks_dropped": cost.chunks_dropped,
                    "echo_refused": cost.echo_refused, "nll_bounded": cost.bounded, "top_k": k,
                    "kld": "exact" if whole else f"lower bound ({k} asked a position; the entries not listed, or whose text "
                                                    f"several ids share, lumped)"}
