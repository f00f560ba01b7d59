"""Errors: one exception type and the handlers that render every failure, in OpenAI's
shape unless the route family registered its own (Anthropic's on /v1/messages*)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("ring.api")

_STATUS_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
    504: "timeout",
}
_TYPE_NAMES = {"str", "int", "float", "bool", "list", "dict", "none", "function-after"}


class APIError(Exception):
    """An error answered to the client as {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or _STATUS_TYPES.get(status, "server_error")
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        """The OpenAI error object."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def refused(message: str) -> Callable[[Any], Any]:
    """A field validator (`field_validator(name)(refused(...))`) for a request field this
    server does not take: any value but None is a 400 that names the field and says
    `message`."""

    def check(value: Any) -> Any:
        if value is not None:
            raise ValueError(message)
        return value

    return check


def unavailable(message: str, retry_after: int = 2) -> APIError:
    """503 with Retry-After: the ranks are down, loading or stopping."""
    return APIError(
        503,
        message,
        type="service_unavailable",
        code="ranks_unavailable",
        headers={"Retry-After": str(retry_after)},
    )


def _param(loc: tuple[Any, ...]) -> str | None:
    parts = [
        str(part)
        for part in loc
        if part != "body" and not (isinstance(part, str) and ("[" in part or part in _TYPE_NAMES))
    ]
    return ".".join(parts) or None


def validation_error(errors: list[dict[str, Any]]) -> APIError:
    """Turn pydantic/FastAPI validation errors into one 400 that names the field."""
    if not errors:
        return APIError(400, "The request body is invalid.")
    first = errors[0]
    kind = first.get("type", "")
    param = _param(tuple(first.get("loc", ())))
    if kind == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        message = f"The request body is not valid JSON ({detail}); send a JSON object."
        return APIError(400, message, code="invalid_json")
    message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    if param is None:
        if kind == "missing":
            return APIError(400, "The request body is missing; send a JSON object.")
        if kind == "value_error":  # a check across fields
            return APIError(400, f"Invalid request: {message}.")
        return APIError(400, "The request body must be a JSON object.")
    given = first.get("input")
    shown = ""
    if kind != "missing" and (given is None or isinstance(given, str | int | float | bool)):
        text = repr(given)
        shown = f" (got {text[:60]}{'...' if len(text) > 60 else ''})"
    if kind == "missing":
        return APIError(400, f"Missing required parameter '{param}'.", param=param)
    if kind == "extra_forbidden":
        return APIError(400, f"Unrecognized parameter '{param}'.", param=param)
    return APIError(400, f"Invalid value for '{param}': {message}{shown}.", param=param)


# (path prefix, renderer): routes whose clients expect another error shape.
ErrorShape = tuple[str, Callable[[APIError], JSONResponse]]


def shaped(app_state: Any, path: str, error: APIError) -> JSONResponse:
    """The error in the shape the clients of `path` expect (OpenAI's by default)."""
    shapes: list[ErrorShape] = getattr(app_state, "error_shapes", [])
    for prefix, render in shapes:
        if path.startswith(prefix):
            return render(error)
    return error.response()


def respond(request: Request, error: APIError) -> JSONResponse:
    return shaped(request.app.state, request.url.path, error)


async def _api_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return respond(request, exc)


async def _validation(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    return respond(request, validation_error(list(exc.errors())))


async def _http(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    status = exc.status_code
    if status == 404:
        message = f"Unknown path {request.url.path}; see /docs for the routes this server has."
        error = APIError(404, message, code="not_found")
    elif status == 405:
        message = f"Method {request.method} is not allowed on {request.url.path}."
        error = APIError(405, message, code="method_not_allowed")
    else:
        error = APIError(status, str(exc.detail))
    error.headers.update(exc.headers or {})
    return respond(request, error)


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.error("internal error on %s %s: %r", request.method, request.url.path, exc)
    message = "The server hit an internal error; the details are in api.log."
    return respond(request, APIError(500, message, type="server_error", code="internal_error"))


def install_error_handlers(app: FastAPI) -> None:
    """Route every failure through the OpenAI error shape."""
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation)
    app.add_exception_handler(StarletteHTTPException, _http)
    app.add_exception_handler(Exception, _unexpected)
