"""FastAPI application: GET /health, POST /execute (SSE), POST /cancel, OpenAI-compatible
POST /v1/completions, POST /v1/chat/completions (streaming or not), GET /v1/models.

Validation: unknown fields are rejected; a bad or out-of-range field is HTTP 400 with one message per
field. With an API token, every route but /health needs `Authorization: Bearer <token>` (401 otherwise).
When the queue is full: 503 with Retry-After.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import re
import time
import uuid
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..errors import LlorchError
from ..generate.sampling import SamplingParams
from .worker import JobIdInUse, QueueFull, Worker

STOP_REASONS = {"max_tokens": "MAX_TOKENS", "eos": "EOS", "stop_sequence": "STOP_SEQUENCE",
                "cancelled": "CANCELLED", "context_full": "MAX_TOKENS"}
OPENAI_FINISH = {"max_tokens": "length", "context_full": "length", "eos": "stop", "stop_sequence": "stop",
                 "cancelled": "stop"}


class Strict(BaseModel):
    """Unknown fields are refused, and nothing is coerced: "2" is not a number, true is not 1."""
    model_config = ConfigDict(extra="forbid", strict=True)


class Sampling(Strict):
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: list[str] | str | None = None
    max_tokens: int | None = Field(default=None)


# job ids go into the X-Job-Id header: visible ASCII only, so the response can never fail after queueing
JOB_ID_PATTERN = r"[!-~]{1,200}"


class ExecuteRequest(Sampling):
    job_id: str | None = None
    prompt: str = Field(min_length=1)

    @field_validator("job_id")
    @classmethod
    def _header_safe(cls, v):
        if v is not None and not re.fullmatch(JOB_ID_PATTERN, v):
            raise ValueError("1-200 visible ASCII characters, no spaces (it is sent back in the X-Job-Id header)")
        return v


class StreamOptions(Strict):
    include_usage: bool = False


class OpenAIRequest(Sampling):
    """Fields the official client sends that llorch-ref applies, or accepts only at their no-op value."""
    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Literal[1] = 1
    user: str | None = None               # an end-user id for the provider's abuse monitoring: nothing to apply
    logit_bias: dict[str, float] | None = Field(default=None, max_length=0)
    logprobs: bool | int | None = None

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, v):
        if v not in (None, False) or v is True:     # false / 0 / null: the no-op values
            raise ValueError("log-probabilities are not implemented by llorch-ref; send false or leave it out")
        return v

    @model_validator(mode="after")
    def _options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed with stream: true")
        return self


class CompletionRequest(OpenAIRequest):
    prompt: str = Field(min_length=1)
    echo: Literal[False] = False
    best_of: Literal[1] | None = None
    suffix: None = None


class ContentPart(Strict):
    type: str
    text: str | None = None

    @model_validator(mode="after")
    def _text_only(self):
        if self.type != "text" or self.text is None:
            raise ValueError(f"content part type {self.type!r} is not supported (text parts only)")
        return self


class Message(Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart]

    def plain(self) -> dict:
        """-> {role, content} for the chat template: developer is the system role of newer models; text
        parts are joined as the OpenAI API joins them."""
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class ResponseFormat(Strict):
    type: Literal["text"]


class ChatRequest(OpenAIRequest):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = None
    response_format: ResponseFormat | None = None
    top_logprobs: None = None

    @model_validator(mode="after")
    def _one_max(self):
        if self.max_completion_tokens is not None:
            if self.max_tokens is not None and self.max_tokens != self.max_completion_tokens:
                raise ValueError("max_tokens and max_completion_tokens differ: give one")
            self.max_tokens = self.max_completion_tokens
        return self


# OpenAI fields llorch-ref does not implement: refused by name, never ignored
OPENAI_UNSUPPORTED = {"tools", "tool_choice", "functions", "function_call", "parallel_tool_calls", "audio",
                      "modalities", "prediction", "reasoning_effort", "service_tier", "store", "metadata",
                      "web_search_options", "name", "tool_calls", "tool_call_id", "refusal"}


def _error(status, code, message, fields=None, headers=None):
    body = {"error": {"code": code, "message": message}}
    if fields:
        body["error"]["fields"] = fields
    return JSONResponse(body, status_code=status, headers=headers)


class GuardMiddleware:
    """Pure ASGI guard in front of the app (pure, so the app still sees the client's disconnect): the bearer
    token on every route but /health (401, before any body is read); POST bodies must be JSON (415), at most
    max_body bytes (413), and arrive within body_timeout seconds (408), so a slow or endless client cannot
    pin the server."""

    def __init__(self, app, max_body: int, body_timeout: float, api_token: str | None = None):
        self.app, self.max_body, self.body_timeout = app, max_body, body_timeout
        self.api_token = api_token.encode() if api_token else None

    def _auth_error(self, headers):
        h = headers.get(b"authorization", b"")
        if not h.startswith(b"Bearer "):
            return "MISSING_API_KEY", "missing bearer token (Authorization: Bearer <token>)"
        if not hmac.compare_digest(h[7:], self.api_token):
            return "INVALID_API_KEY", "invalid bearer token"
        return None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        if self.api_token and scope["path"] != "/health":
            err = self._auth_error(headers)
            if err:
                return await _send_error(send, 401, *err)
        if scope["method"] != "POST":
            return await self.app(scope, receive, send)
        ctype = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
        if ctype != b"application/json":
            return await _send_error(send, 415, "UNSUPPORTED_MEDIA_TYPE",
                                     f"Content-Type must be application/json, got {ctype.decode(errors='replace')!r}")
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body):
            return await _send_error(send, 413, "BODY_TOO_LARGE", f"request body over {self.max_body} bytes")
        body, more = b"", True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.body_timeout
        while more:
            try:
                msg = await asyncio.wait_for(receive(), timeout=max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                return await _send_error(send, 408, "REQUEST_TIMEOUT", f"body not received within {self.body_timeout} s")
            if msg["type"] == "http.disconnect":
                return
            body += msg.get("body", b"")
            more = msg.get("more_body", False)
            if len(body) > self.max_body:
                return await _send_error(send, 413, "BODY_TOO_LARGE", f"request body over {self.max_body} bytes")
        sent = False

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()
        return await self.app(scope, replay, send)


async def _send_error(send, status, code, message):
    data = json.dumps({"error": {"code": code, "message": message}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data})


def create_app(engine, api_token: str | None = None, max_queue: int = 16, model_name: str | None = None,
               default_temperature_openai: float = 1.0, max_body: int = 1 << 20, body_timeout: float = 10.0) -> FastAPI:
    if api_token is not None and not api_token:
        raise ValueError("api_token is empty: pass None for no authentication")
    app = FastAPI(title="llorch-ref worker", version=__import__("llorch_ref").__version__)
    app.add_middleware(GuardMiddleware, max_body=max_body, body_timeout=body_timeout, api_token=api_token)
    worker = Worker(engine, max_queue=max_queue)
    app.state.worker = worker
    name = model_name or (engine.path.name if engine.path else "llorch-ref")
    watchers: set[asyncio.Task] = set()

    @app.exception_handler(RequestValidationError)
    async def _bad_request(request, exc):
        fields = {}
        for err in exc.errors():
            loc = ".".join(str(x) for x in err["loc"] if x != "body") or "body"
            last = str(err["loc"][-1]) if err["loc"] else ""
            if err["type"] != "extra_forbidden":
                fields[loc] = err["msg"]
            elif last in OPENAI_UNSUPPORTED:
                fields[loc] = "an OpenAI field that llorch-ref does not implement"
            else:
                fields[loc] = "unknown field"
        return _error(400, "INVALID_REQUEST", "invalid request: " + "; ".join(f"{k}: {v}" for k, v in fields.items()),
                      fields)

    def prepare(req, openai: bool):
        """Request -> (Engine.generate kwargs, {field: message}). Tokenizes: runs in a thread, off the loop."""
        data = req.model_dump(exclude_none=True)
        sampling = {k: data[k] for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                                         "presence_penalty", "frequency_penalty", "seed") if k in data}
        if openai:
            sampling.setdefault("temperature", default_temperature_openai)
        fields = SamplingParams(**sampling).errors()
        max_tokens = data.get("max_tokens", 16 if openai else 128)
        if not 1 <= max_tokens <= engine.n_ctx:
            fields["max_tokens"] = f"must be in 1..{engine.n_ctx}, got {max_tokens}"
        stop = data.get("stop", [])
        stop = [stop] if isinstance(stop, str) else stop
        if len(stop) > 4 or any(not s or len(s) > 100 for s in stop):
            fields["stop"] = "at most 4 non-empty strings of at most 100 characters"
        kw = dict(max_tokens=max_tokens, stop=stop, **sampling)
        if isinstance(req, ChatRequest):
            kw["messages"] = [m.plain() for m in req.messages]
        else:
            kw["prompt"] = req.prompt
        where = "prompt" if "prompt" in kw else "messages"
        if not fields:                  # tokenize only a request that is otherwise valid
            try:
                ids = engine.encode_prompt(kw.get("prompt"), messages=kw.get("messages"))
                if len(ids) + 1 > engine.n_ctx:
                    fields[where] = f"{len(ids)} tokens leave no room in the context of {engine.n_ctx}"
            except LlorchError as e:    # the tokenizer or the chat template
                fields[where] = str(e)
        return kw, fields

    async def start_job(req, request: Request, openai: bool, job_id: str):
        """Admission, preparation off the event loop, then the queue; -> (job, None) or (None, response).
        The slot taken at admission is given back on every path that does not make a job, and the job is
        tied to its connection from the moment it is queued."""
        try:
            worker.admit()
        except QueueFull as e:
            return None, _error(503, "QUEUE_FULL", f"server busy: {e}; retry later", headers={"Retry-After": "1"})
        job = None
        try:
            kw, fields = await asyncio.to_thread(prepare, req, openai)
            if fields:
                return None, _error(400, "INVALID_REQUEST",
                                    "invalid request: " + "; ".join(f"{k}: {v}" for k, v in fields.items()), fields)
            try:
                job = worker.submit(kw, job_id, admitted=True)
            except JobIdInUse as e:
                return None, _error(409, "JOB_ID_IN_USE", str(e), {"job_id": "already queued or running"})
        finally:
            if job is None:
                worker.release()
        watch = asyncio.create_task(_cancel_on_disconnect(job, request.receive))
        watchers.add(watch)
        watch.add_done_callback(watchers.discard)
        job.watch = watch
        return job, None

    async def _cancel_on_disconnect(job, receive):
        """The job's tie to its connection: when the client goes away, the job is cancelled (a queued job
        leaves the queue at once). Ended when the job's response is done."""
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                job.client_left = True
                worker.cancel_job(job)
                return

    async def events(job):
        """Yields (kind, payload) until the job ends; if the consumer stops early (the response stream was
        closed: the client went away), the job is cancelled."""
        done = False
        try:
            while not done:
                kind, payload = await job.events.get()
                done = kind in ("end", "error")
                yield kind, payload
        finally:
            job.watch.cancel()
            if not done:
                worker.cancel_job(job)

    def sse(obj) -> str:
        return "data: " + json.dumps(obj, ensure_ascii=False) + "\n\n"

    @app.get("/health")
    async def health():
        return {"status": "healthy", "model": name, "backend": engine.backend.name, "numerics": engine.numerics,
                "state": worker.state, "queued": worker.pending, "max_queue": worker.max_queue,
                "served": worker.served, "cancelled": worker.cancelled, "tokens_out": worker.tokens_out,
                "tokens_after_client_left": worker.tokens_after_client_left}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "llorch-ref"}]}

    @app.post("/cancel")
    async def cancel(body: dict):
        job_id = body.get("job_id") if isinstance(body, dict) else None
        if not isinstance(job_id, str) or not job_id or set(body) != {"job_id"}:
            return _error(400, "INVALID_REQUEST", "body must be {\"job_id\": \"...\"}", {"job_id": "required"})
        if not worker.cancel(job_id):
            return _error(404, "NO_SUCH_JOB", f"no queued or running job has job_id {job_id[:200]!r}")
        return JSONResponse({"job_id": job_id, "status": "cancelling"}, status_code=202)

    @app.post("/execute")
    async def execute(req: ExecuteRequest, request: Request):
        job, err = await start_job(req, request, openai=False, job_id=req.job_id or uuid.uuid4().hex)
        if err:
            return err

        async def stream():
            async for kind, p in events(job):
                if kind == "started":
                    yield sse({"type": "started", "job_id": job.job_id, "model": name,
                               "started_at": p["started_at"]})
                elif kind == "token":
                    yield sse({"type": "token", "t": p["t"], "i": p["i"]})
                elif kind == "end":
                    r = p
                    yield sse({"type": "end", "tokens_out": len(r.token_ids),
                               "decode_time_ms": round(r.decode_s * 1000, 3),
                               "stop_reason": STOP_REASONS.get(r.stop_reason, "ERROR"),
                               "stop_sequence_matched": r.stop_sequence, "seed": r.seed})
                else:
                    yield sse({"type": "error", **p})
        return StreamingResponse(stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Job-Id": job.job_id})

    async def run_openai(req, request, chat: bool):
        oid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        job, err = await start_job(req, request, openai=True, job_id=oid)
        if err:
            return err
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"
        headers = {"X-Job-Id": oid}

        def choice(text=None, finish=None, first=False):
            if chat:
                delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
                return {"index": 0, "delta": delta, "finish_reason": finish}
            return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}

        def usage(r):
            return {"prompt_tokens": len(r.prompt_ids), "completion_tokens": len(r.token_ids),
                    "total_tokens": len(r.prompt_ids) + len(r.token_ids)}

        if req.stream:
            chunk_obj = obj + ".chunk" if chat else obj
            include_usage = req.stream_options is not None and req.stream_options.include_usage

            def chunk(choices, **extra):
                return sse({"id": oid, "object": chunk_obj, "created": created, "model": name, "choices": choices,
                            **({"usage": None} if include_usage else {}), **extra})

            async def stream():
                async for kind, p in events(job):
                    if kind == "started" and chat:
                        yield chunk([choice(first=True)])
                    elif kind == "token":
                        yield chunk([choice(p["t"])])
                    elif kind == "end":
                        yield chunk([choice(finish=OPENAI_FINISH[p.stop_reason])],
                                    **({} if include_usage else {"usage": usage(p)}))
                        if include_usage:
                            yield sse({"id": oid, "object": chunk_obj, "created": created, "model": name,
                                       "choices": [], "usage": usage(p)})
                        yield "data: [DONE]\n\n"
                    elif kind == "error":
                        yield sse({"error": p})
            return StreamingResponse(stream(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", **headers})

        text, result = "", None
        async for kind, p in events(job):
            if kind == "token":
                text += p["t"]
            elif kind == "end":
                result = p
            elif kind == "error":
                return _error(500 if p["code"] == "INFERENCE_FAILED" else 400, p["code"], p["message"])
        if result.stop_reason == "cancelled":       # the client went away, or /cancel named this job
            return _error(499, "CANCELLED", "cancelled: the client disconnected or the job was cancelled",
                          headers=headers)
        finish = OPENAI_FINISH[result.stop_reason]
        ch = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish} if chat
              else {"index": 0, "text": text, "logprobs": None, "finish_reason": finish})
        return JSONResponse({"id": oid, "object": obj, "created": created, "model": name, "choices": [ch],
                             "usage": usage(result), "system_fingerprint": f"llorch-ref-seed-{result.seed}"},
                            headers=headers)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        return await run_openai(req, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatRequest, request: Request):
        return await run_openai(req, request, chat=True)

    return app
