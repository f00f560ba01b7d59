"""Rank 0's events as a Response and its stream: the documented event sequence
(response.created, response.in_progress; per output item output_item.added, its deltas,
its done events, output_item.done; then response.completed, or response.incomplete when
the answer hit its cap or the context's end). A whole (non-streamed) response is built by
the same builder, so both carry the same items."""

from __future__ import annotations

import uuid
from typing import Any

from gateway.errors import APIError
from gateway.openai.protocol import Performance
from gateway.responses.protocol import (
    IncompleteDetails,
    OutputFunctionCall,
    OutputItem,
    OutputMessage,
    OutputReasoning,
    OutputText,
    ReasoningText,
    Response,
    ResponseUsage,
)
from ipc.protocol import Delta, Done, ToolCallDelta

Event = dict[str, Any]


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseBuilder:
    """Fills `response` from rank 0's events; each call returns the stream events it makes."""

    def __init__(self, response: Response) -> None:
        self.response = response
        self.sequence = 0
        self.open: OutputItem | None = None

    def opening(self) -> list[Event]:
        snapshot = self.response.model_dump(mode="json")
        return [
            self._event("response.created", response=snapshot),
            self._event("response.in_progress", response=snapshot),
        ]

    def feed(self, message: Delta | Done) -> list[Event]:
        if isinstance(message, Done):
            return self._finish(message)
        events: list[Event] = []
        if message.reasoning:
            events += self._reasoning(message.reasoning)
        if message.text:
            events += self._text(message.text)
        for piece in message.tool_calls:
            events += self._call(piece)
        return events

    def error(self, exc: APIError) -> Event:
        detail = exc.body()["error"]
        return self._event("error", code=detail["code"], message=exc.message, param=exc.param)

    # ---- items ---------------------------------------------------------------------------

    def _event(self, kind: str, **fields: Any) -> Event:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def _add(self, item: OutputItem, shown: dict[str, Any]) -> list[Event]:
        events = self._close("completed")
        self.open = item
        self.response.output.append(item)
        index = len(self.response.output) - 1
        return [*events, self._event("response.output_item.added", output_index=index, item=shown)]

    @property
    def _where(self) -> dict[str, Any]:
        assert self.open is not None
        return {"item_id": self.open.id, "output_index": len(self.response.output) - 1}

    def _reasoning(self, text: str) -> list[Event]:
        events: list[Event] = []
        if not isinstance(self.open, OutputReasoning):
            item = OutputReasoning(id=item_id("rs"), content=[ReasoningText(text="")])
            events += self._add(item, item.model_dump(mode="json"))
        assert isinstance(self.open, OutputReasoning)
        self.open.content[0].text += text
        delta = self._event("response.reasoning_text.delta", **self._where, content_index=0)
        return [*events, delta | {"delta": text}]

    def _text(self, text: str) -> list[Event]:
        events: list[Event] = []
        if not isinstance(self.open, OutputMessage):
            item = OutputMessage(id=item_id("msg"), status="in_progress", content=[])
            events += self._add(item, item.model_dump(mode="json"))
            part = OutputText(text="")
            item.content.append(part)
            events.append(
                self._event(
                    "response.content_part.added",
                    **self._where,
                    content_index=0,
                    part=part.model_dump(mode="json"),
                )
            )
        assert isinstance(self.open, OutputMessage)
        if not text:
            return events
        self.open.content[0].text += text
        delta = self._event(
            "response.output_text.delta", **self._where, content_index=0, delta=text, logprobs=[]
        )
        return [*events, delta]

    def _call(self, piece: ToolCallDelta) -> list[Event]:
        events: list[Event] = []
        if piece.id is not None or not isinstance(self.open, OutputFunctionCall):
            item = OutputFunctionCall(
                id=item_id("fc"),
                call_id=piece.id or item_id("call"),
                name=piece.name or "",
                arguments="",
                status="in_progress",
            )
            events += self._add(item, item.model_dump(mode="json"))
        assert isinstance(self.open, OutputFunctionCall)
        if piece.arguments:
            self.open.arguments += piece.arguments
            events.append(
                self._event(
                    "response.function_call_arguments.delta", **self._where, delta=piece.arguments
                )
            )
        return events

    def _close(self, status: str) -> list[Event]:
        item = self.open
        if item is None:
            return []
        index = len(self.response.output) - 1
        events = []
        if isinstance(item, OutputMessage):
            item.status = "completed" if status == "completed" else "incomplete"
            part = item.content[0]
            events += [
                self._event(
                    "response.output_text.done",
                    **self._where,
                    content_index=0,
                    text=part.text,
                    logprobs=[],
                ),
                self._event(
                    "response.content_part.done",
                    **self._where,
                    content_index=0,
                    part=part.model_dump(mode="json"),
                ),
            ]
        elif isinstance(item, OutputReasoning):
            text = item.content[0].text
            events.append(
                self._event(
                    "response.reasoning_text.done", **self._where, content_index=0, text=text
                )
            )
        else:
            item.status = "completed"
            events.append(
                self._event(
                    "response.function_call_arguments.done",
                    **self._where,
                    name=item.name,
                    arguments=item.arguments,
                )
            )
        events.append(
            self._event(
                "response.output_item.done", output_index=index, item=item.model_dump(mode="json")
            )
        )
        self.open = None
        return events

    def _finish(self, done: Done) -> list[Event]:
        capped = done.finish_reason == "length"
        events: list[Event] = []
        if not self.response.output:  # an empty answer is still one (empty) message
            events += self._text("")
        events += self._close("incomplete" if capped else "completed")
        response = self.response
        response.status = "incomplete" if capped else "completed"
        if capped:
            response.incomplete_details = IncompleteDetails(reason="max_output_tokens")
        response.usage = ResponseUsage.of(done.usage)
        response.performance = Performance.of(done.timings)
        name = "response.incomplete" if capped else "response.completed"
        return [*events, self._event(name, response=response.model_dump(mode="json"))]
