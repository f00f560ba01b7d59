"""Errors in Anthropic's shape, {"type": "error", "error": {"type", "message"}}, for the
/v1/messages routes: as a response, and as a stream's `error` event."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

from gateway import sse
from gateway.errors import APIError

PREFIX = "/v1/messages"
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
}


def error_body(error: APIError) -> dict[str, Any]:
    status = error.status
    kind = _TYPES.get(status, "invalid_request_error" if 400 <= status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": error.message}}


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error_body(error), status_code=error.status, headers=error.headers)


def error_event(error: APIError) -> str:
    """An error after the stream began (HTTP 200 already sent); the stream ends after it."""
    return sse.named_event("error", error_body(error))
