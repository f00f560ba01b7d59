"""POST /v1/messages and /v1/messages/count_tokens: Anthropic requests to rank 0 and its
events back, as a Message or as Anthropic's event stream.

Anthropic clients name Claude models (coding agents hard-code them): a model name that
starts with "claude" selects the served model here, as does any of its own names.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from gateway import sse
from gateway.anthropic.convert import count_submit, message_submit
from gateway.anthropic.errors import error_event
from gateway.anthropic.protocol import (
    AnthropicUsage,
    CountTokensRequest,
    MessageResponse,
    MessagesRequest,
    StopReason,
    TokenCount,
)
from gateway.core import Generation, Limits, served_model
from ipc.protocol import Delta, Done, ToolCall, Usage

router = APIRouter(tags=["anthropic"])  # API_KEY: gateway/auth.ApiKeyGate


def anthropic_model(request: Request, requested: str | None) -> str:
    """The served id for an Anthropic request's model (Claude names map to it)."""
    if requested is not None and requested.casefold().startswith("claude"):
        requested = None
    return served_model(request.app.state.rank_client, requested)


def stop_reason(done: Done) -> StopReason:
    if done.finish_reason == "tool_calls":
        return "tool_use"
    if done.finish_reason == "length":
        return "max_tokens"
    return "stop_sequence" if done.stop_sequence is not None else "end_turn"


def usage_of(usage: Usage) -> AnthropicUsage:
    """Anthropic counts cached prompt tokens apart from the others."""
    cached = usage.prompt_tokens_details.cached_tokens
    return AnthropicUsage(
        input_tokens=usage.prompt_tokens - cached,
        output_tokens=usage.completion_tokens,
        cache_read_input_tokens=cached,
    )


def tool_use(call: ToolCall) -> dict[str, Any]:
    return {"type": "tool_use", "id": call.id, "name": call.name, "input": call_input(call)}


def call_input(call: ToolCall) -> dict[str, Any]:
    try:
        value = json.loads(call.arguments or "{}")
    except ValueError:  # cut off at max_tokens: the raw text is all there is
        return {"_partial_arguments": call.arguments}
    return value if isinstance(value, dict) else {"value": value}


@router.post("/v1/messages", response_model=MessageResponse)
async def messages(body: MessagesRequest, request: Request) -> MessageResponse | StreamingResponse:
    """Generate the assistant's next message (Anthropic's Messages API)."""
    model = anthropic_model(request, body.model)
    submit = message_submit(body, f"msg_{uuid.uuid4().hex[:24]}", Limits.of(request.app.state))
    generation = Generation(request, submit, "messages")
    started = await generation.start()
    if body.stream:
        render = MessageStream(submit.id, model, started.prompt_tokens)
        return generation.stream(render, render.opening(), error=error_event)
    result = await generation.collect()
    content: list[dict[str, Any]] = []
    if result.reasoning:
        content.append({"type": "thinking", "thinking": result.reasoning, "signature": ""})
    if result.text or not (result.tool_calls or result.reasoning):
        content.append({"type": "text", "text": result.text})
    content += [tool_use(call) for call in result.tool_calls]
    return MessageResponse(
        id=submit.id,
        model=model,
        content=content,
        stop_reason=stop_reason(result.done),
        stop_sequence=result.done.stop_sequence,
        usage=usage_of(result.done.usage),
    )


@router.post("/v1/messages/count_tokens", response_model=TokenCount)
async def count_tokens(body: CountTokensRequest, request: Request) -> TokenCount:
    """The prompt's token count, exactly as /v1/messages would render it (tools included)."""
    anthropic_model(request, body.model)
    submit = count_submit(body, f"count_{uuid.uuid4().hex[:24]}")
    generation = Generation(request, submit, "messages")
    started = await generation.start()
    await generation.collect()
    return TokenCount(input_tokens=started.prompt_tokens)


class MessageStream:
    """Rank 0's events as Anthropic's stream: message_start and ping at once; then content
    blocks (thinking, text, tool_use) each opened, filled with deltas and closed in
    order; message_delta with the stop reason and usage; message_stop."""

    def __init__(self, message_id: str, model: str, prompt_tokens: int) -> None:
        self.message_id = message_id
        self.model = model
        self.prompt_tokens = prompt_tokens
        self.open: str | None = None  # the open block's type
        self.index = -1  # the open (or last) block's index

    def opening(self) -> Iterator[str]:
        message: dict[str, Any] = {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": self.prompt_tokens, "output_tokens": 0},
        }
        yield sse.named_event("message_start", {"type": "message_start", "message": message})
        yield sse.named_event("ping", {"type": "ping"})

    def _event(self, name: str, **fields: Any) -> str:
        return sse.named_event(name, {"type": name, **fields})

    def _close(self) -> Iterator[str]:
        if self.open is not None:
            yield self._event("content_block_stop", index=self.index)
            self.open = None

    def _start(self, block: dict[str, Any]) -> Iterator[str]:
        yield from self._close()
        self.index += 1
        self.open = block["type"]
        yield self._event("content_block_start", index=self.index, content_block=block)

    def _delta(self, delta: dict[str, Any]) -> str:
        return self._event("content_block_delta", index=self.index, delta=delta)

    def __call__(self, message: Delta | Done) -> Iterator[str]:
        if isinstance(message, Done):
            yield from self._close()
            delta = {"stop_reason": stop_reason(message), "stop_sequence": message.stop_sequence}
            usage = usage_of(message.usage).model_dump()
            yield self._event("message_delta", delta=delta, usage=usage)
            yield self._event("message_stop")
            return
        if message.reasoning:
            if self.open != "thinking":
                yield from self._start({"type": "thinking", "thinking": "", "signature": ""})
            yield self._delta({"type": "thinking_delta", "thinking": message.reasoning})
        if message.text:
            if self.open != "text":
                yield from self._start({"type": "text", "text": ""})
            yield self._delta({"type": "text_delta", "text": message.text})
        for piece in message.tool_calls:
            if piece.id is not None:
                block: dict[str, Any] = {
                    "type": "tool_use",
                    "id": piece.id,
                    "name": piece.name,
                    "input": {},
                }
                yield from self._start(block)
            if piece.arguments:
                yield self._delta({"type": "input_json_delta", "partial_json": piece.arguments})
