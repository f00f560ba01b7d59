"""Optional bearer-token check (API_KEY), compared in constant time."""

from __future__ import annotations

import hmac

from fastapi import Request

from gateway.errors import APIError


def require_api_key(request: Request) -> None:
    """FastAPI dependency: 401 in OpenAI's shape unless the bearer token equals API_KEY."""
    expected: str = request.app.state.settings.api_key
    if not expected:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    challenge = {"WWW-Authenticate": "Bearer"}
    if not header or scheme.lower() != "bearer" or not token.strip():
        raise APIError(
            401,
            "Missing API key: send it as the header 'Authorization: Bearer <API_KEY>'.",
            code="invalid_api_key",
            headers=challenge,
        )
    if not hmac.compare_digest(token.strip().encode(), expected.encode()):
        raise APIError(
            401,
            "Incorrect API key provided: the bearer token does not match this server's API_KEY.",
            code="invalid_api_key",
            headers=challenge,
        )
