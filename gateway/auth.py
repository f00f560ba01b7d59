"""Optional API key check (API_KEY), compared in constant time. The key comes as
`Authorization: Bearer <key>` (OpenAI's SDK, Anthropic's SDK 2.x) or `x-api-key: <key>`
(older Anthropic clients, curl examples)."""

from __future__ import annotations

import hmac

from fastapi import Request

from gateway.errors import APIError

HOW = "send it as 'Authorization: Bearer <API_KEY>' or 'x-api-key: <API_KEY>'"


def presented_key(request: Request) -> str | None:
    """The key the client sent, or None when it sent none in either header."""
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if header and scheme.lower() == "bearer" and token.strip():
        return token.strip()
    api_key = request.headers.get("x-api-key", "").strip()
    return api_key or None


def require_api_key(request: Request) -> None:
    """FastAPI dependency: 401 unless the presented key equals API_KEY."""
    expected: str = request.app.state.settings.api_key
    if not expected:
        return
    challenge = {"WWW-Authenticate": "Bearer"}
    key = presented_key(request)
    if key is None:
        raise APIError(401, f"Missing API key: {HOW}.", code="invalid_api_key", headers=challenge)
    if not hmac.compare_digest(key.encode(), expected.encode()):
        raise APIError(
            401,
            "Incorrect API key provided: it does not match this server's API_KEY.",
            code="invalid_api_key",
            headers=challenge,
        )
