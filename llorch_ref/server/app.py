"""The worker's FastAPI application: GET /health, POST /execute (SSE), POST /cancel, OpenAI-compatible
POST /v1/completions, POST /v1/chat/completions (streaming or not), GET /v1/models.

Validation: unknown fields are rejected; a bad or out-of-range field is HTTP 400 with one message per
field. With an API token, every route but /health needs `Authorization: Bearer <token>` (401 otherwise).
When the queue is full: 503 with Retry-After. The pieces: schemas.py (request bodies), guard.py (token,
body limits, error shape), gateway.py (request -> job -> events), routes.py, worker.py (the job lifecycle).
"""
from __future__ import annotations

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError

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
