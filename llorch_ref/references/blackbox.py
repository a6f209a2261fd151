"""Black-box engines under test: what an engine that exposes no tensors still serves, its greedy tokens and their
log-probabilities, as one `Trace` (harness/blackbox.py compares it with the reference, teacher-forced).

- openai_trace: any OpenAI-compatible server (`/v1/completions` with `logprobs`, or `/v1/chat/completions` with
  `top_logprobs`), the prompt's tokenization from its tokenize route where it has one (llama-cpp-python's
  `/extras/tokenize`, llama-server's and vLLM's `/tokenize`). Servers name tokens by their text: each is matched to
  an id by its bytes in the reference's vocabulary; a text several ids share is ambiguous (kept apart, see Step).
- mistralrs_trace: mistral.rs (PyPI `mistralrs`) on a local GGUF, a raw template, log-probabilities with ids.

Every failure to get a usable trace is a BlackBoxError, one line.
"""
from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import BlackBoxError
from ..tokenizer import TOKEN_CONTROL, TOKEN_USER_DEFINED

RAW_TEMPLATE = "{{ messages[0]['content'] }}"      # the prompt as it is: no chat template


@dataclass
class Step:
    """One greedy step as the engine reported it: the token it chose (its id), that token's log-probability, and
    the log-probabilities it gave (id -> logprob: the whole vocabulary, or its top K); `ambiguous`: the engine's
    entries whose text several ids of the vocabulary share (text -> logprob), which no id can be given to."""
    token: int
    logprob: float
    top: dict
    ambiguous: dict = field(default_factory=dict)
    text: str = ""
    shared: bool = False                # the chosen token's text is several ids': its id is the first of them


@dataclass
class Trace:
    """An engine's greedy run: the prompt, its tokenization where the engine told it (prompt_ids, and how:
    'tokenize route /extras/tokenize', 'reported by the engine', or None), its steps, what it was asked for
    (top_k: log-probabilities per step; whole: the whole vocabulary), and the engine's name and settings."""
    engine: str
    version: str
    prompt: str
    steps: list
    top_k: int
    whole: bool
    prompt_ids: list | None = None
    tokenized_by: str | None = None
    completion_text: str | None = None
    settings: dict = field(default_factory=dict)
    chat: bool = False
    stop_reason: str | None = None


def piece_index(tokenizer) -> tuple[dict, dict]:
    """-> (text -> id for every token whose text is its own, text -> ids for the texts several ids share). The text
    of a token is its bytes decoded as UTF-8 with undecodable bytes dropped (what llama-cpp-python's server names
    it by)."""
    seen: dict = {}
    for i in range(tokenizer.n_vocab):
        seen.setdefault(tokenizer.token_bytes(i).decode("utf-8", errors="ignore"), []).append(i)
    unique = {s: ids[0] for s, ids in seen.items() if len(ids) == 1}
    return unique, {s: ids for s, ids in seen.items() if len(ids) > 1}


def mergeable_ids(tokenizer, shared: dict) -> set:
    """The ids a text-keyed answer may merge with others or name otherwise, so that it holds fewer entries than
    asked: those whose text another id has, the control and user-defined tokens (llama.cpp reads them as empty
    text) and those over
    32 bytes (llama-cpp-python's detokenize cuts them)."""
    out = {i for ids in shared.values() for i in ids}
    types = getattr(tokenizer, "token_types", None) or []
    out |= {i for i, t in enumerate(types) if t in (TOKEN_CONTROL, TOKEN_USER_DEFINED)}
    return out | {i for i in range(tokenizer.n_vocab) if len(tokenizer.token_bytes(i)) > 32}


def token_of(text: str, index: dict, shared: set, what: str) -> int | None:
    """The id of a token named by its text ('token_id:N' where the server gives ids): None where the text is shared
    by several ids; a text the vocabulary has not is another tokenizer (BlackBoxError)."""
    if text.startswith("token_id:") and text[9:].isdigit():
        return int(text[9:])
    if text in index:
        return index[text]
    if text in shared:
        return None
    raise BlackBoxError(f"{what}: the engine's token {text!r} is not in the reference's vocabulary (another "
                        f"tokenizer, or another model)")


# -- OpenAI-compatible servers --------------------------------------------------------------------------------
def post(url: str, path: str, body: dict, timeout: float) -> dict:
    """POST a JSON body; -> the JSON answer. No answer inside `timeout` seconds, a refused connection, an HTTP
    error or an answer that is not JSON: BlackBoxError, one line naming the route."""
    req = urllib.request.Request(url.rstrip("/") + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    where = f"{url.rstrip('/')}{path}"
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            data = r.read()
    except urllib.error.HTTPError as e:
        detail = e.read()[:200].decode("utf-8", errors="replace").replace("\n", " ")
        raise BlackBoxError(f"{where}: HTTP {e.code} {e.reason}: {detail}") from None
    except (socket.timeout, TimeoutError):
        raise BlackBoxError(f"{where}: no answer in {timeout:g} s (timeout)") from None
    except urllib.error.URLError as e:
        reason = "no answer (timeout)" if isinstance(e.reason, (socket.timeout, TimeoutError)) else str(e.reason)
        raise BlackBoxError(f"{where}: {reason}") from None
    except (ConnectionError, OSError) as e:
        raise BlackBoxError(f"{where}: {e}") from None
    try:
        return json.loads(data)
    except json.JSONDecodeError:
        raise BlackBoxError(f"{where}: the answer is not JSON ({data[:80]!r})") from None


TOKENIZE_ROUTES = (("/extras/tokenize", "input"), ("/tokenize", "content"), ("/tokenize", "prompt"))


def server_tokenize(url: str, text: str, timeout: float) -> tuple[list | None, str | None]:
    """-> (the server's token ids of `text`, the route) from the first tokenize route it answers (llama-cpp-python:
    /extras/tokenize {input}; llama-server: /tokenize {content}; vLLM: /tokenize {prompt}); (None, None) where it
    has none. A route that answers without a `tokens` list counts as none."""
    for path, key in TOKENIZE_ROUTES:
        try:
            out = post(url, path, {key: text}, timeout)
        except BlackBoxError as e:
            if "timeout" in str(e) or "HTTP" not in str(e):
                raise
            continue
        toks = out.get("tokens") if isinstance(out, dict) else None
        if isinstance(toks, list) and all(isinstance(t, int) for t in toks):
            return toks, path
    return None, None


def completion_request(prompt: str, n_steps: int, top_k: int, chat: bool) -> tuple[str, dict]:
    """-> (route, body) of a greedy request for n_steps tokens with top_k log-probabilities a step (temperature 0,
    no penalties: the engine's argmax)."""
    common = {"max_tokens": n_steps, "temperature": 0.0, "top_p": 1.0, "repeat_penalty": 1.0,
              "frequency_penalty": 0.0, "presence_penalty": 0.0, "stream": False}
    if chat:
        return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": prompt}],
                                        "logprobs": True, "top_logprobs": top_k}
    return "/v1/completions", {**common, "prompt": prompt, "logprobs": top_k}


def parse_completion(out: dict, tokenizer, top_k: int, where: str) -> tuple[list, str, str | None]:
    """-> (steps, text, finish reason) of a /v1/completions answer (logprobs: tokens, token_logprobs, top_logprobs
    as text -> logprob)."""
    try:
        choice = out["choices"][0]
        lp = choice["logprobs"]
        tokens, token_lps, tops = lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]
    except (KeyError, IndexError, TypeError):
        raise BlackBoxError(f"{where}: the answer has no logprobs (tokens, token_logprobs, top_logprobs): the server "
                            f"does not give log-probabilities (llama-cpp-python: --logits_all true)") from None
    entries = [[(t, float(v)) for t, v in (top or {}).items()] for top in tops]
    return _steps(tokens, token_lps, entries, tokenizer, top_k, where), choice.get("text", ""), \
        choice.get("finish_reason")


def parse_chat(content: list, tokenizer, top_k: int, where: str, ids=False) -> list:
    """-> steps of a chat answer's logprobs.content ([{token, logprob, top_logprobs: [{token, logprob}]}]). ids:
    the entries' `token` is an id (mistral.rs), else the token's text."""
    def get(e, k):
        return e[k] if isinstance(e, dict) else getattr(e, k)
    tokens = [get(c, "token") for c in content]
    lps = [float(get(c, "logprob")) for c in content]
    entries = [[(get(e, "token"), float(get(e, "logprob"))) for e in get(c, "top_logprobs")] for c in content]
    if ids:
        chosen = [_chosen_id(get(c, "bytes") or get(c, "token"), lp, es, tokenizer)
                  for c, lp, es in zip(content, lps, entries)]
        return _steps(chosen, lps, entries, tokenizer, top_k, where, ids=True)
    return _steps(tokens, lps, entries, tokenizer, top_k, where)


def _chosen_id(text, logprob: float, entries: list, tokenizer) -> int:
    """The id of the chosen token where the engine names it by text but lists ids: the listed id with its bytes
    and its log-probability, else the listed id with its bytes."""
    want = text.encode("utf-8") if isinstance(text, str) else bytes(text)
    match = [i for i, _ in entries if 0 <= int(i) < tokenizer.n_vocab and tokenizer.token_bytes(int(i)) == want]
    exact = [i for i, v in entries if i in match and v == logprob]
    if not (exact or match):
        raise BlackBoxError(f"the engine's chosen token {want!r} is not among its listed log-probabilities")
    return int((exact or match)[0])


def _steps(tokens, token_lps, entries, tokenizer, top_k: int, where: str, ids=False) -> list:
    """Steps from parallel lists: the chosen tokens (ids, or texts matched by their bytes), their log-probabilities
    and each step's (token, logprob) entries. Refuses an id outside the vocabulary (another vocabulary size) and a
    step with fewer entries than asked: by ids, fewer than min(K, V); by texts, fewer than half of min(K, V - the
    mergeable ids) (a text several ids share, a control token, a long token cut short, is one entry: on a code
    prompt 12 of a top 100 merge)."""
    n_vocab = tokenizer.n_vocab
    index, shared = (None, None) if ids else piece_index(tokenizer)
    # a text-keyed answer merges what mergeable_ids names: over the whole vocabulary all of them, in a top K some
    want = min(top_k, n_vocab - len(mergeable_ids(tokenizer, shared))) // 2 if not ids else min(top_k, n_vocab)
    steps = []
    for k, (tok, lp, es) in enumerate(zip(tokens, token_lps, entries)):
        what = f"{where} step {k}"
        top, amb = {}, {}
        for t, v in es:
            i = int(t) if ids else token_of(str(t), index, shared, what)
            if i is None:
                amb[str(t)] = v
                continue
            if not 0 <= i < n_vocab:
                raise BlackBoxError(f"{what}: token id {i} is outside the reference's vocabulary of {n_vocab} (a "
                                    f"vocabulary of another size: another model)")
            top[i] = v
        if len(top) + len(amb) > n_vocab:
            raise BlackBoxError(f"{what}: {len(top) + len(amb)} log-probabilities, more than the reference's "
                                f"vocabulary of {n_vocab} (a vocabulary of another size: another model)")
        if len(top) + len(amb) < want:
            raise BlackBoxError(f"{what}: {len(top) + len(amb)} log-probabilities, fewer than the {top_k} asked")
        chosen = int(tok) if ids else token_of(str(tok), index, shared, what)
        many = chosen is None
        if many:                            # a text several ids share: the first of them (named in the row)
            chosen = shared[str(tok)][0]
        if not 0 <= chosen < n_vocab:
            raise BlackBoxError(f"{what}: chosen token id {chosen} is outside the reference's vocabulary of {n_vocab} "
                                f"(a vocabulary of another size: another model)")
        steps.append(Step(token=chosen, logprob=float(lp), top=top, ambiguous=amb,
                          text=tokenizer.token_bytes(chosen).decode("utf-8", "replace"), shared=many))
    return steps


def openai_trace(url: str, prompt: str, tokenizer, n_steps: int = 32, top_k: int = 20, chat: bool = False,
                 timeout: float = 120.0) -> Trace:
    """A greedy run of an OpenAI-compatible server: its tokenization of the prompt (where it has a tokenize route;
    with chat, of the prompt as the reference's template renders it), then n_steps greedy tokens with top_k
    log-probabilities each. `tokenizer`: the reference's, which names the server's tokens by their bytes."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}]) if chat else prompt
    ids, route = server_tokenize(url, text, timeout)
    path, body = completion_request(prompt, n_steps, top_k, chat)
    out = post(url, path, body, timeout)
    where = f"{url.rstrip('/')}{path}"
    if chat:
        try:
            choice = out["choices"][0]
            content = choice["logprobs"]["content"]
        except (KeyError, IndexError, TypeError):
            raise BlackBoxError(f"{where}: the answer has no logprobs.content: the server does not give "
                                f"log-probabilities on its chat route") from None
        steps, done, reason = parse_chat(content, tokenizer, top_k, where), \
            (choice.get("message") or {}).get("content", ""), choice.get("finish_reason")
    else:
        steps, done, reason = parse_completion(out, tokenizer, top_k, where)
    if not steps:
        raise BlackBoxError(f"{where}: the server returned no tokens")
    return Trace(engine="openai", version=str(out.get("model", "")), prompt=text, steps=steps, top_k=top_k,
                 whole=top_k >= tokenizer.n_vocab, prompt_ids=ids,
                 tokenized_by=f"tokenize route {route}" if route else None, completion_text=done,
                 settings={"url": url, "route": path, **{k: v for k, v in body.items() if k not in ("prompt", "messages")}},
                 chat=chat, stop_reason=reason)


# -- mistral.rs -----------------------------------------------------------------------------------------------
def mistralrs_trace(model_path, prompt: str, tokenizer, n_steps: int = 32, top_k: int | None = None,
                    workdir=None) -> Trace:
    """A greedy run of mistral.rs on the GGUF file at model_path with the raw template (the prompt as it is) and
    top_k log-probabilities a step (default: the whole vocabulary). Not installed: BlackBoxError saying so."""
    try:
        import mistralrs
    except ImportError:
        raise BlackBoxError("--subject mistralrs needs the mistralrs wheel (pip install mistralrs, or the "
                            "'blackbox' extra)") from None
    import tempfile

    path = Path(model_path).resolve()
    top_k = tokenizer.n_vocab if top_k is None else top_k
    with tempfile.TemporaryDirectory(dir=workdir) as d:
        tpl = Path(d) / "raw.jinja"
        tpl.write_text(RAW_TEMPLATE)
        try:
            runner = mistralrs.Runner(which=mistralrs.Which.GGUF(quantized_model_id=str(path.parent),
                                                                 quantized_filename=path.name),
                                      jinja_explicit=str(tpl))
            res = runner.send_chat_completion_request(mistralrs.ChatCompletionRequest(
                model="default", messages=[{"role": "user", "content": prompt}], max_tokens=n_steps,
                temperature=0.0, logprobs=True, top_logprobs=top_k))
        except Exception as e:                 # the wheel raises its own types (ValueError, RuntimeError, ...)
            raise BlackBoxError(f"mistral.rs on {path.name}: {type(e).__name__}: {str(e).splitlines()[0][:200]}") \
                from None
    choice = res.choices[0]
    steps = parse_chat(choice.logprobs.content, tokenizer, top_k, "mistral.rs", ids=True)
    n_prompt = getattr(res.usage, "prompt_tokens", None)
    return Trace(engine="mistral.rs", version=getattr(mistralrs, "__version__", "") or _dist_version("mistralrs"),
                 prompt=prompt, steps=steps, top_k=top_k, whole=top_k >= tokenizer.n_vocab, prompt_ids=None,
                 tokenized_by=None, completion_text=choice.message.content,
                 settings={"model": str(path), "template": RAW_TEMPLATE, "temperature": 0.0, "top_logprobs": top_k,
                           "prompt_tokens": n_prompt},
                 stop_reason=getattr(choice, "finish_reason", None))


def _dist_version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return ""
