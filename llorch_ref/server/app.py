"""The worker's FastAPI application: GET /health, POST /execute (SSE), POST /cancel, POST /tokenize,
OpenAI-compatible POST /v1/completions, POST /v1/chat/completions (streaming or not; log-probabilities on
non-streaming requests, logprobs.py), GET /v1/models.

Validation: unknown fields are rejected; a bad or out-of-range field is HTTP 400 with one message per
field. With an API token, every route but /health needs `Authorization: Bearer <token>` (401 otherwise).
When the queue is full: 503 with Retry-After. The pieces: schemas.py (request bodies), guard.py (token,
body limits, error shape), gateway.py (request -> job -> events), routes.py, worker.py (the job lifecycle).
"""
from __future__ import annotations

import sys

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import __version__
from .gateway import Gateway
from .guard import GuardMiddleware, error_response
from .routes import openai_routes, worker_routes
from .schemas import OPENAI_UNSUPPORTED


def create_app(engine, api_token: str | None = None, max_queue: int = 16, model_name: str | None = None,
               default_temperature_openai: float = 1.0, max_body: int = 1 << 20, body_timeout: float = 10.0) -> FastAPI:
    if api_token is not None and not api_token:
        raise ValueError("api_token is empty: pass None for no authentication")
    app = FastAPI(title="llorch-ref worker", version=__version__)
    app.add_middleware(GuardMiddleware, max_body=max_body, body_timeout=body_timeout, api_token=api_token)
    gw = Gateway(engine, max_queue, model_name or (engine.path.name if engine.path else "llorch-ref"),
                 default_temperature_openai)
    app.state.worker = gw.worker
    app.add_exception_handler(RequestValidationError, _bad_request)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.include_router(worker_routes(gw))
    app.include_router(openai_routes(gw))
    return app


async def _bad_request(request, exc):
    """A body that does not validate: 400 with one message per field (an OpenAI field that llorch-ref does not
    implement named as such)."""
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
    return error_response(400, "INVALID_REQUEST", "invalid request: " + "; ".join(f"{k}: {v}" for k, v in fields.items()),
                          fields)


HTTP_CODES = {400: "INVALID_REQUEST", 404: "NOT_FOUND", 405: "METHOD_NOT_ALLOWED"}


async def _http_error(request, exc):
    """Every error the framework raises (an unknown route or method, a body its JSON parser refuses) in the
    documented shape, never FastAPI's {"detail": ...}. A body the parser refuses is 400 INVALID_REQUEST saying
    why: nesting deeper than Python's parser recurses, or an integer of more digits than Python converts."""
    code = HTTP_CODES.get(exc.status_code, "HTTP_ERROR")
    message = str(exc.detail)
    if exc.status_code == 400:
        message = "invalid request: " + _unparsable(exc.__cause__)
    return error_response(exc.status_code, code, message, headers=getattr(exc, "headers", None))


def _unparsable(cause) -> str:
    """Why the JSON body could not be parsed, in words a client can act on."""
    if isinstance(cause, RecursionError):
        return "the JSON body nests arrays or objects too deeply"
    if isinstance(cause, ValueError) and "digits" in str(cause):
        return f"the JSON body holds an integer of more than {sys.get_int_max_str_digits()} digits"
    return f"the body could not be parsed as JSON ({type(cause).__name__ if cause else 'unknown reason'})"
