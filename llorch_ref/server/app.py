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
import time
import uuid
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from ..generate.sampling import SamplingParams
from .worker import QueueFull, Worker

STOP_REASONS = {"max_tokens": "MAX_TOKENS", "eos": "EOS", "stop_sequence": "STOP_SEQUENCE",
                "cancelled": "CANCELLED", "context_full": "MAX_TOKENS"}
OPENAI_FINISH = {"max_tokens": "length", "context_full": "length", "eos": "stop", "stop_sequence": "stop",
                 "cancelled": "stop"}


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


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


class ExecuteRequest(Sampling):
    job_id: str | None = Field(default=None, min_length=1, max_length=200)
    prompt: str = Field(min_length=1)


class CompletionRequest(Sampling):
    model: str | None = None
    prompt: str = Field(min_length=1)
    stream: bool = False
    n: Literal[1] = 1
    user: str | None = None


class Message(Strict):
    role: Literal["system", "user", "assistant"]
    content: str


class ChatRequest(Sampling):
    model: str | None = None
    messages: list[Message] = Field(min_length=1)
    stream: bool = False
    n: Literal[1] = 1
    user: str | None = None


def _error(status, code, message, fields=None, headers=None):
    body = {"error": {"code": code, "message": message}}
    if fields:
        body["error"]["fields"] = fields
    return JSONResponse(body, status_code=status, headers=headers)


class GuardMiddleware:
    """Pure ASGI guard in front of the app: POST bodies must be JSON (415), at most max_body bytes (413),
    and arrive within body_timeout seconds (408), so a slow or endless client cannot pin the server."""

    def __init__(self, app, max_body: int, body_timeout: float):
        self.app, self.max_body, self.body_timeout = app, max_body, body_timeout

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
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
    app = FastAPI(title="llorch-ref worker", version=__import__("llorch_ref").__version__)
    app.add_middleware(GuardMiddleware, max_body=max_body, body_timeout=body_timeout)
    worker = Worker(engine, max_queue=max_queue)
    app.state.worker = worker
    name = model_name or (engine.path.name if engine.path else "llorch-ref")

    @app.exception_handler(RequestValidationError)
    async def _bad_request(request, exc):
        fields = {}
        for err in exc.errors():
            loc = ".".join(str(x) for x in err["loc"] if x != "body") or "body"
            fields[loc] = err["msg"] if err["type"] != "extra_forbidden" else "unknown field"
        return _error(400, "INVALID_REQUEST", "invalid request: " + "; ".join(f"{k}: {v}" for k, v in fields.items()),
                      fields)

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        if api_token and request.url.path != "/health":
            h = request.headers.get("authorization", "")
            if not h.startswith("Bearer "):
                return _error(401, "MISSING_API_KEY", "missing bearer token (Authorization: Bearer <token>)")
            if not hmac.compare_digest(h[7:].encode(), api_token.encode()):
                return _error(401, "INVALID_API_KEY", "invalid bearer token")
        return await call_next(request)

    def gen_kwargs(req, openai: bool):
        """Request -> Engine.generate kwargs, or a 400 response listing every bad field."""
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
            kw["messages"] = [m.model_dump() for m in req.messages]
        else:
            kw["prompt"] = req.prompt
        try:
            ids = engine.encode_prompt(kw.get("prompt"), messages=kw.get("messages"))
            if len(ids) + 1 > engine.n_ctx:
                fields["prompt" if "prompt" in kw else "messages"] = \
                    f"{len(ids)} tokens leave no room in the context of {engine.n_ctx}"
        except Exception as e:  # LlorchError from the tokenizer or template
            fields["prompt" if "prompt" in kw else "messages"] = str(e)
        if fields:
            return None, _error(400, "INVALID_REQUEST",
                                "invalid request: " + "; ".join(f"{k}: {v}" for k, v in fields.items()), fields)
        return kw, None

    def submit(kw, job_id=None):
        try:
            return worker.submit(kw, job_id), None
        except QueueFull as e:
            return None, _error(503, "QUEUE_FULL", f"server busy: {e}; retry later", headers={"Retry-After": "1"})

    async def events(job, request: Request):
        """Yields (kind, payload) until the job ends; cancels the job if the client goes away (the
        response generator is closed, or the connection is seen closed while waiting)."""
        done = False
        try:
            while True:
                try:
                    kind, payload = await asyncio.wait_for(job.events.get(), timeout=0.25)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        return
                    continue
                if kind in ("end", "error"):
                    done = True
                yield kind, payload
                if done:
                    return
        finally:
            if not done:
                job.cancel.set()

    def sse(obj) -> str:
        return "data: " + json.dumps(obj, ensure_ascii=False) + "\n\n"

    @app.get("/health")
    async def health():
        return {"status": "healthy", "model": name, "backend": engine.backend.name, "numerics": engine.numerics,
                "state": worker.state, "queued": worker.pending, "max_queue": worker.max_queue,
                "served": worker.served}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "llorch-ref"}]}

    @app.post("/cancel")
    async def cancel(body: dict):
        job_id = body.get("job_id") if isinstance(body, dict) else None
        if not isinstance(job_id, str) or not job_id or set(body) != {"job_id"}:
            return _error(400, "INVALID_REQUEST", "body must be {\"job_id\": \"...\"}", {"job_id": "required"})
        worker.cancel(job_id)
        return JSONResponse({"job_id": job_id, "status": "cancelling"}, status_code=202)

    @app.post("/execute")
    async def execute(req: ExecuteRequest, request: Request):
        kw, err = gen_kwargs(req, openai=False)
        if err:
            return err
        job, err = submit(kw, req.job_id)
        if err:
            return err

        async def stream():
            async for kind, p in events(job, request):
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
        kw, err = gen_kwargs(req, openai=True)
        if err:
            return err
        job, err = submit(kw)
        if err:
            return err
        created, oid = int(time.time()), ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        obj = "chat.completion" if chat else "text_completion"

        def choice(text=None, finish=None, first=False):
            if chat:
                delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
                return {"index": 0, "delta": delta, "finish_reason": finish}
            return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}

        if req.stream:
            async def stream():
                async for kind, p in events(job, request):
                    if kind == "started" and chat:
                        yield sse({"id": oid, "object": obj + ".chunk", "created": created, "model": name,
                                   "choices": [choice(first=True)]})
                    elif kind == "token":
                        yield sse({"id": oid, "object": obj + ".chunk" if chat else obj, "created": created,
                                   "model": name, "choices": [choice(p["t"])]})
                    elif kind == "end":
                        yield sse({"id": oid, "object": obj + ".chunk" if chat else obj, "created": created,
                                   "model": name, "choices": [choice(finish=OPENAI_FINISH[p.stop_reason])],
                                   "usage": {"prompt_tokens": len(p.prompt_ids),
                                             "completion_tokens": len(p.token_ids),
                                             "total_tokens": len(p.prompt_ids) + len(p.token_ids)}})
                        yield "data: [DONE]\n\n"
                    elif kind == "error":
                        yield sse({"error": p})
            return StreamingResponse(stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

        text, result = "", None
        async for kind, p in events(job, request):
            if kind == "token":
                text += p["t"]
            elif kind == "end":
                result = p
            elif kind == "error":
                return _error(500 if p["code"] == "INFERENCE_FAILED" else 400, p["code"], p["message"])
        if result is None:          # client went away
            return _error(499, "CANCELLED", "client disconnected")
        finish = OPENAI_FINISH[result.stop_reason]
        usage = {"prompt_tokens": len(result.prompt_ids), "completion_tokens": len(result.token_ids),
                 "total_tokens": len(result.prompt_ids) + len(result.token_ids)}
        ch = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish} if chat
              else {"index": 0, "text": text, "logprobs": None, "finish_reason": finish})
        return {"id": oid, "object": obj, "created": created, "model": name, "choices": [ch], "usage": usage,
                "system_fingerprint": f"llorch-ref-seed-{result.seed}"}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        return await run_openai(req, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatRequest, request: Request):
        return await run_openai(req, request, chat=True)

    return app
