"""The API key (API_KEY): one rule for what it protects, checked in one place.

With API_KEY set, every request needs the key except:
- the health probes `/health`, `/health/live`, `/health/ready` (orchestrators and load
  balancers call them without one);
- pages that hold none of this server's state: the dashboard's page (`/dashboard`, and
  `/` for a browser, which gets that page) and its files under `/dashboard/static/`, and
  the API's own docs (`/docs`, `/redoc`, `/openapi.json`: the routes, as in the README).
Everything else needs it, whatever the route: the completions, the models, `/model/info`,
`/cluster/status`, `/metrics`, `/dashboard/state` (the page asks for the key before it
reads it), and `/` as JSON (the service info). `ApiKeyGate`, an ASGI middleware around
every route, applies the rule before routing, so a route added later is covered without
naming it, and a missing or wrong key gets 401 before the body is read or validated.

The key comes as `Authorization: Bearer <key>` (OpenAI's SDK, Anthropic's SDK 2.x) or
`x-api-key: <key>` (older Anthropic clients, curl examples), compared in constant time.
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.errors import APIError, shaped

HOW = "send it as 'Authorization: Bearer <API_KEY>' or 'x-api-key: <API_KEY>'"
OPEN_PATHS = frozenset(
    {
        "/health",
        "/health/live",
        "/health/ready",
        "/dashboard",
        "/docs",
        "/docs/oauth2-redirect",
        "/redoc",
        "/openapi.json",
    }
)
OPEN_PREFIXES = ("/dashboard/static/",)


def is_open(path: str, accept: str = "") -> bool:
    """Whether `path` answers without the key (the rule above); `/` only to a browser
    (`accept` lists text/html), which gets the dashboard's page there."""
    if path == "/":
        return "text/html" in accept
    return path in OPEN_PATHS or path.startswith(OPEN_PREFIXES)


def presented_key(headers: Mapping[str, str]) -> str | None:
    """The key the client sent, or None when it sent none in either header."""
    header = headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if header and scheme.lower() == "bearer" and token.strip():
        return token.strip()
    api_key = headers.get("x-api-key", "").strip()
    return api_key or None


def refusal(expected: str, key: str | None) -> APIError | None:
    """The 401 for `key` where API_KEY (`expected`) is set and `key` is not it; else None."""
    if not expected:
        return None
    challenge = {"WWW-Authenticate": "Bearer"}
    if key is None:
        return APIError(401, f"Missing API key: {HOW}.", code="invalid_api_key", headers=challenge)
    if not hmac.compare_digest(key.encode(), expected.encode()):
        return APIError(
            401,
            "Incorrect API key provided: it does not match this server's API_KEY.",
            code="invalid_api_key",
            headers=challenge,
        )
    return None


class ApiKeyGate:
    """ASGI middleware: every HTTP request outside `is_open` needs API_KEY (when set); a
    refusal is shaped for the path's clients (Anthropic's under /v1/messages)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.api_key = api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.api_key:
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        path: str = scope["path"]
        error = None
        if not is_open(path, headers.get("accept", "")):
            error = refusal(self.api_key, presented_key(headers))
        if error is None:
            await self.app(scope, receive, send)
            return
        app_state = getattr(scope.get("app"), "state", None)
        await shaped(app_state, path, error)(scope, receive, send)
