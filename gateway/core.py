"""The generation core every API surface shares: which model is served, the token limits,
and one request's life at rank 0 (submit, a stream of typed events, or all of it collected).

Adapters (gateway/openai/, later others) only translate their wire format to a Submit and
the events back; nothing here knows any API's shapes except the error type.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import PurePath
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from gateway import sse
from gateway.errors import APIError, unavailable
from gateway.rank_client import ConnectionLost, RankClient, RanksUnavailable, RequestEvent
from ipc.protocol import (
    Delta,
    Done,
    Error,
    Started,
    Submit,
    TokenLogprob,
    ToolCall,
    ToolCallDelta,
    ToolChoice,
)

log = logging.getLogger("ring.api")


def model_aliases(model_id: str, others: Iterable[str] = ()) -> set[str]:
    """Names that select the served model: its id and older names rank 0 reports, each
    with its last path part (with and without a .gguf suffix), and "default"; compared
    case-insensitively."""
    names = {"default"}
    for known in (model_id, *others):
        name = PurePath(known.rstrip("/")).name
        names |= {known, name, name.removesuffix(".gguf")}
    return {alias.casefold() for alias in names if alias}


def served_model(client: RankClient, requested: str | None) -> str:
    """The served model id for `requested` (None: the served model); 404 model_not_found
    or 503 when unknown."""
    model_id = client.model_id
    if model_id is None:
        now = client.availability()
        raise unavailable(f"The ranks are not available: {now.reason}.", now.retry_after or 2)
    if requested is None:
        return model_id
    if requested.casefold() not in model_aliases(model_id, client.model_aliases):
        raise APIError(
            404,
            f"The model '{requested}' does not exist on this server; it serves '{model_id}' "
            "(GET /v1/models lists it).",
            param="model",
            code="model_not_found",
        )
    return model_id


def check_tool_choice(choice: ToolChoice, names: list[str]) -> None:
    """A forced choice needs tools, and a named one must be among them."""
    if choice.mode in ("required", "function") and not names:
        raise ValueError(
            f"tool_choice {choice.name or choice.mode!r} needs tools; send the tools the "
            "model may call"
        )
    if choice.mode == "function" and choice.name not in names:
        raise ValueError(
            f"it names {choice.name!r}, which is not in tools ({', '.join(names)}); name one "
            "of them"
        )


@dataclass(frozen=True)
class Limits:
    """The answer's cap a request carries to rank 0 (docs/ARCHITECTURE.md, "A cap is not a
    demand"): the client's own, else DEFAULT_MAX_TOKENS. Rank 0 alone knows the prompt's
    length, so it alone turns the cap into the budget (leader/scheduler.py `budget`)."""

    default_max_tokens: int

    @classmethod
    def of(cls, state: Any) -> Limits:
        return cls(state.settings.default_max_tokens)

    def max_tokens(self, requested: int | None) -> int:
        """The cap sent to rank 0: any size is accepted, the context bounds the answer."""
        return requested or self.default_max_tokens


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def system_fingerprint(client: RankClient) -> str:
    """Changes when the model, backend or split changes."""
    status = client.status
    parts = [client.model_id or ""]
    if status is not None:
        parts += [status.backend, str(status.world_size), json.dumps(status.plan, sort_keys=True)]
    return "fp_" + hashlib.sha256("|".join(parts).encode()).hexdigest()[:12]


def rank_error(error: Error, prompt_param: str) -> APIError:
    """Map rank 0's Error for a request to the HTTP error the client gets."""
    if error.code == "prompt_too_long":
        return APIError(400, error.message, param=prompt_param, code="context_length_exceeded")
    if error.code == "invalid_request":
        return APIError(400, error.message, param=error.param)
    if error.code in ("loading", "shutting_down"):
        return unavailable(f"The ranks cannot take requests now: {error.message}", 5)
    return APIError(
        500, f"rank 0 failed the request: {error.message}", type="server_error", code=error.code
    )


def assemble_calls(pieces: Iterable[ToolCallDelta]) -> list[ToolCall]:
    """Whole tool calls from their streamed pieces (id and name first, then arguments)."""
    calls: dict[int, ToolCall] = {}
    for piece in pieces:
        call = calls.get(piece.index)
        if call is None:
            call = calls[piece.index] = ToolCall(
                id=piece.id or "", name=piece.name or "", arguments=""
            )
        call.arguments += piece.arguments
    return [calls[index] for index in sorted(calls)]


@dataclass
class Collected:
    """A whole generation: its text, reasoning, tool calls, per-token logprobs (when asked
    for) and Done."""

    text: str
    done: Done
    logprobs: list[TokenLogprob] = field(default_factory=list)
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)


class Generation:
    """Submit one request to rank 0 and follow it to the end."""

    def __init__(self, request: Request, submit: Submit, prompt_param: str) -> None:
        state = request.app.state
        self.request = request
        self.client: RankClient = state.rank_client
        self.metrics = state.metrics
        self.telemetry = state.telemetry
        self.submit = submit
        self.prompt_param = prompt_param
        self.deadline = time.monotonic() + state.settings.request_timeout_seconds
        self.timeout = state.settings.request_timeout_seconds
        self.finished = False
        self._queue: asyncio.Queue[RequestEvent] | None = None
        self._disconnect: asyncio.Task[None] | None = None
        self._started_at = 0.0
        self._last_text_at: float | None = None

    async def start(self) -> Started:
        """Submit and wait until rank 0 accepts the request (or refuses it)."""
        self._started_at = time.monotonic()
        try:
            self._queue = await self.client.submit(self.submit)
        except RanksUnavailable as exc:
            message = f"The ranks are not available: {exc.message}."
            raise unavailable(message, exc.retry_after) from None
        self.metrics.in_flight.inc()
        self._disconnect = asyncio.create_task(self._watch_disconnect())
        message = await self._next()
        if isinstance(message, Started):
            self.metrics.tokens.labels("prompt").inc(message.prompt_tokens)
            return message
        self.finished = True
        self.close()
        if isinstance(message, Error):
            raise rank_error(message, self.prompt_param)
        raise APIError(
            500,
            f"rank 0 answered with {message.type} before started",
            type="server_error",
            code="protocol_error",
        )

    async def events(self) -> AsyncIterator[Delta | Done]:
        """Deltas then Done; raises APIError on a rank error, a lost connection or timeout."""
        try:
            while True:
                message = await self._next()
                if isinstance(message, Delta):
                    self._observe(message)
                    yield message
                elif isinstance(message, Done):
                    self.finished = True
                    if message.finish_reason == "cancelled":
                        raise unavailable("The ranks cancelled the request (shutting down?).", 5)
                    self.metrics.tokens.labels("completion").inc(message.usage.completion_tokens)
                    self.telemetry.finished(message)
                    yield message
                    return
                elif isinstance(message, Error):
                    self.finished = True
                    raise rank_error(message, self.prompt_param)
        finally:
            self.close()

    async def collect(self) -> Collected:
        """Every event, gathered: the whole text, its logprobs and the Done."""
        text: list[str] = []
        reasoning: list[str] = []
        pieces: list[ToolCallDelta] = []
        logprobs: list[TokenLogprob] = []
        async for message in self.events():
            if isinstance(message, Delta):
                text.append(message.text)
                reasoning.append(message.reasoning)
                pieces += message.tool_calls
                logprobs += message.logprobs or []
            else:
                calls = assemble_calls(pieces)
                return Collected("".join(text), message, logprobs, "".join(reasoning), calls)
        raise AssertionError("events() ends with Done or raises")

    def stream(
        self,
        render: Callable[[Delta | Done], Iterable[str]],
        opening: Iterable[str] = (),
        error: Callable[[APIError], str] = lambda exc: sse.event(exc.body()),
    ) -> StreamingResponse:
        """Server-sent events: `opening` at once, then `render` turns each event into SSE
        lines; an error mid-stream becomes one `error` event (OpenAI's shape by default)."""

        async def lines() -> AsyncIterator[str]:
            try:
                for line in opening:
                    yield line
                async for message in self.events():
                    for line in render(message):
                        yield line
            except APIError as exc:
                self.metrics.errors.labels(exc.type, exc.code or "").inc()
                yield error(exc)
            finally:
                self.close()

        return StreamingResponse(lines(), media_type="text/event-stream", headers=sse.HEADERS)

    def close(self) -> None:
        """Idempotent: stop watching; cancel at rank 0 unless the request finished there."""
        if self._queue is None:
            return
        self._queue = None
        self.metrics.in_flight.dec()
        if self._disconnect is not None:
            self._disconnect.cancel()
        self.client.release(self.submit.id, cancel=not self.finished)
        if not self.finished:
            log.info("request %s cancelled at rank 0", self.submit.id)

    def _observe(self, delta: Delta) -> None:
        now = time.monotonic()
        if self._last_text_at is None:
            self.metrics.ttft.observe(now - self._started_at)
        else:
            self.metrics.inter_token.observe(now - self._last_text_at)
        self._last_text_at = now

    async def _watch_disconnect(self) -> None:
        while True:
            message = await self.request.receive()
            if message["type"] == "http.disconnect":
                return

    async def _next(self) -> Any:
        assert self._queue is not None
        remaining = self.deadline - time.monotonic()
        getter = asyncio.ensure_future(self._queue.get())
        assert self._disconnect is not None
        done, _ = await asyncio.wait(
            {getter, self._disconnect},
            timeout=max(remaining, 0),
            return_when=asyncio.FIRST_COMPLETED,
        )
        if getter not in done:
            getter.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await getter
            if self._disconnect in done:
                self.close()
                raise APIError(499, "The client closed the connection.", code="client_closed")
            self.close()
            raise APIError(
                504,
                f"The request did not finish within REQUEST_TIMEOUT_SECONDS={self.timeout:g} s; "
                "it was cancelled. Ask for fewer tokens or raise the limit.",
                type="timeout",
                code="request_timeout",
            )
        message = getter.result()
        if isinstance(message, ConnectionLost):
            self.finished = True
            self.close()
            raise unavailable(f"The request was lost: {message.reason}.", 2)
        return message
