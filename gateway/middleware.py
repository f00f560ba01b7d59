"""Pure ASGI middleware: request body size limit (413) and one log line + metric per request."""

from __future__ import annotations

import logging
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.errors import APIError, shaped
from gateway.routers.metrics import Metrics

log = logging.getLogger("ring.api")


class BodyLimit:
    """Refuse bodies over `max_bytes` with 413 before any route sees them."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _too_large(self, size: int | None) -> APIError:
        got = f"{size} bytes" if size is not None else f"more than {self.max_bytes} bytes"
        return APIError(
            413,
            f"The request body is {got}; this server accepts at most "
            f"MAX_REQUEST_BYTES={self.max_bytes} bytes.",
            code="request_too_large",
        )

    def _refuse(self, scope: Scope, size: int | None) -> ASGIApp:
        app = scope.get("app")
        return shaped(getattr(app, "state", None), scope["path"], self._too_large(size))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(scope, int(declared))(scope, receive, send)
            return
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] != "http.request":
                await self.app(scope, _replay(message, receive), send)
                return
            body += message.get("body", b"")
            if len(body) > self.max_bytes:
                await self._refuse(scope, None)(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        replay: Message = {"type": "http.request", "body": bytes(body), "more_body": False}
        await self.app(scope, _replay(replay, receive), send)


def _replay(first: Message, receive: Receive) -> Receive:
    pending = [first]

    async def replayed() -> Message:
        if pending:
            return pending.pop()
        return await receive()

    return replayed


class AccessLog:
    """One line per finished request and the api_requests counter."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.monotonic()
        status = [500]

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            route = scope.get("route")
            path = getattr(route, "path", None) or "unmatched"
            self.metrics.requests.labels(path, str(status[0])).inc()
            if status[0] >= 400:
                self.metrics.errors.labels(str(status[0]), "http").inc()
            if not scope["path"].startswith(("/health", "/metrics")) or status[0] >= 500:
                elapsed = time.monotonic() - started
                log.info("%s %s %d %.3fs", scope["method"], scope["path"], status[0], elapsed)
