"""In front of every route: the bearer token, the body's type, size and arrival time (pure ASGI, so the
app still sees the client's disconnect); and the one shape of every error response."""
from __future__ import annotations

import asyncio
import hmac
import json

from fastapi.responses import JSONResponse


def error_response(status, code, message, fields=None, headers=None):
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
        """None for `Authorization: Bearer <token>` with this server's token, the scheme in any case and one or
        more spaces after it (RFC 9110: the scheme is case-insensitive); the token compared in constant time."""
        scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
        token = token.lstrip(b" ")
        if scheme.lower() != b"bearer" or not token:
            return "MISSING_API_KEY", "missing bearer token (Authorization: Bearer <token>)"
        if not hmac.compare_digest(token, self.api_token):
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
