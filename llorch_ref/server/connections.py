"""The HTTP server around the app: uvicorn, with a deadline for request headers.

uvicorn closes a kept-alive connection that stays idle after a response, but not one that never finishes
its headers: a client that connects and sends nothing, or half a request line, holds a socket forever
(the app's own 408 covers a body that does not arrive). Here every connection must complete a request's
headers within header_timeout seconds of connecting, and of each response's end.
"""
from __future__ import annotations

import importlib.util
import logging
import time


def _base_protocol():
    """The HTTP protocol class uvicorn's "auto" picks: httptools if installed, else h11."""
    if importlib.util.find_spec("httptools") is not None:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
        return HttpToolsProtocol
    from uvicorn.protocols.http.h11_impl import H11Protocol
    return H11Protocol


def protocol_with_header_deadline(header_timeout: float):
    base = _base_protocol()

    class HeaderDeadlineProtocol(base):
        """Closes the connection when no request's headers complete within header_timeout seconds of the
        connection opening or of the last response ending (uvicorn makes a new cycle per request)."""

        def _arm(self):
            seen = self.cycle

            def deadline():
                idle = seen is None or seen.response_complete
                if self.cycle is seen and idle and not self.transport.is_closing():
                    self.transport.close()
            self._header_timer = self.loop.call_later(header_timeout, deadline)

        def connection_made(self, transport):
            super().connection_made(transport)
            self._arm()

        def on_response_complete(self):
            super().on_response_complete()
            self._header_timer.cancel()
            self._arm()

        def connection_lost(self, exc):
            timer = getattr(self, "_header_timer", None)
            if timer is not None:
                timer.cancel()
            super().connection_lost(exc)

    return HeaderDeadlineProtocol


class AcceptErrorFilter(logging.Filter):
    """When file descriptors run out, asyncio logs a traceback for every failed accept() (75,666 of them in
    8 s with 150 idle sockets and a limit of 64): one line every `every` seconds instead, with the count."""

    def __init__(self, every: float = 5.0):
        super().__init__()
        self.every, self.last, self.suppressed = every, float("-inf"), 0

    def filter(self, record):
        msg = str(record.msg)
        if msg.startswith("Exception in callback") and "_start_serving" in msg:
            return False        # the retry of accept() firing after shutdown closed the socket: harmless
        if not msg.startswith("socket.accept() out of system resource"):
            return True
        now = time.monotonic()
        if now - self.last < self.every:
            self.suppressed += 1
            return False
        exc = record.exc_info[1] if record.exc_info else None
        why = getattr(exc, "strerror", None) or exc or "out of system resources"
        record.msg = (f"llorch-ref: cannot accept connections: {why} (too many open files? raise ulimit -n); "
                      f"{self.suppressed} more such errors since the last report")
        record.args, record.exc_info, record.exc_text = (), None, None
        self.last, self.suppressed = now, 0
        return True


def raise_open_file_limit():
    """Soft limit of open files up to the hard limit: each connection holds a descriptor."""
    try:
        import resource
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard == resource.RLIM_INFINITY or soft < hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else max(soft, 65536),
                                                        hard))
    except (ImportError, ValueError, OSError):
        pass


_FILTER = AcceptErrorFilter()


def make_server(app, host: str, port: int, header_timeout: float = 10.0, shutdown_grace: float = 10.0,
                timeout_keep_alive: float = 5.0, log_level: str = "warning"):
    """-> a uvicorn.Server for app (call .run())."""
    import uvicorn

    log = logging.getLogger("asyncio")
    if _FILTER not in log.filters:
        log.addFilter(_FILTER)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_keep_alive=timeout_keep_alive,
                            timeout_graceful_shutdown=shutdown_grace,
                            http=protocol_with_header_deadline(header_timeout))
    return uvicorn.Server(config)
