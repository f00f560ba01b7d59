"""Responses API <-> rank 0: input items become the same conversation (ChatMessage list) the
chat template renders for chat completions and Messages, so the prefix cache hits across
APIs; a response's output items become the assistant turn a continued conversation
replays (gateway/responses/stream.py builds those items from rank 0's events).

A conversation continued by `previous_response_id` is the stored conversation (its input
and output, without its instructions, as OpenAI defines it) plus the new items.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from gateway.core import Limits, check_tool_choice
from gateway.responses.protocol import (
    ITEM_TYPES,
    ContentPart,
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionChoice,
    InputItem,
    MessageItem,
    OutputItem,
    OutputMessage,
    OutputReasoning,
    ReasoningItem,
    ResponsesRequest,
)
from ipc import protocol as rank0  # the message rank 0 takes, apart from this API's wire

TEXT_PARTS = {"input_text", "output_text", "text", "summary_text", "reasoning_text"}


class ConversionError(ValueError):
    """A request that cannot become a conversation; `param` names the field at fault."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def parse_items(raw: str | list[dict[str, Any]]) -> list[InputItem]:
    """The input as items: a string is one user message."""
    if isinstance(raw, str):
        return [MessageItem(role="user", content=raw)]
    items: list[InputItem] = []
    for index, item in enumerate(raw):
        kind = item.get("type", "message")
        model = ITEM_TYPES.get(kind)
        if model is None:
            known = ", ".join(ITEM_TYPES)
            raise ConversionError(
                f"input[{index}] is an item of type {kind!r}, which this server cannot replay "
                f"to its model; send {known} items",
                f"input[{index}].type",
            )
        try:
            items.append(model.model_validate(item))
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(part) for part in first["loc"])
            raise ConversionError(
                f"input[{index}] ({kind}): {where}: {first['msg']}", f"input[{index}].{where}"
            ) from None
    return items


def _text(content: str | list[ContentPart], param: str) -> str:
    if isinstance(content, str):
        return content
    texts = []
    for part in content:
        if part.type not in TEXT_PARTS or part.text is None:
            raise ConversionError(
                f"{part.type} content is not supported: this server serves a text model; "
                "send input_text parts",
                param,
            )
        texts.append(part.text)
    return "\n".join(texts)


def conversation(items: list[InputItem]) -> list[rank0.ChatMessage]:
    """Items as chat turns: calls join the assistant turn before them (or open one), their
    outputs become tool turns, reasoning goes to the next assistant turn."""
    out: list[rank0.ChatMessage] = []
    names: dict[str, str] = {}  # call_id -> function name, for the tool turns
    reasoning: list[str] = []

    def assistant_turn() -> rank0.ChatMessage:
        if not out or out[-1].role != "assistant":
            out.append(rank0.ChatMessage(role="assistant"))
        turn = out[-1]
        if reasoning:
            turn.reasoning = "\n".join(filter(None, [turn.reasoning, *reasoning]))
            reasoning.clear()
        return turn

    for index, item in enumerate(items):
        param = f"input[{index}].content"
        if isinstance(item, ReasoningItem):
            parts = item.content if item.content else item.summary
            reasoning += [part.text for part in parts if part.text]
        elif isinstance(item, MessageItem) and item.role == "assistant":
            turn = assistant_turn()
            turn.content = "\n".join(filter(None, [turn.content, _text(item.content, param)]))
        elif isinstance(item, MessageItem):
            role = "user" if item.role == "user" else "system"
            out.append(rank0.ChatMessage(role=role, content=_text(item.content, param)))
        elif isinstance(item, FunctionCallItem):
            names[item.call_id] = item.name
            call = rank0.ToolCall(id=item.call_id, name=item.name, arguments=item.arguments or "{}")
            assistant_turn().tool_calls.append(call)
        elif isinstance(item, FunctionCallOutputItem):
            text = _text(item.output, f"input[{index}].output")
            name = names.get(item.call_id)
            out.append(
                rank0.ChatMessage(role="tool", content=text, tool_call_id=item.call_id, name=name)
            )
    return out


def tool_choice(request: ResponsesRequest, names: list[str]) -> rank0.ToolChoice:
    choice = request.tool_choice
    if choice is None:
        result = rank0.ToolChoice()
    elif isinstance(choice, FunctionChoice):
        result = rank0.ToolChoice(mode="function", name=choice.name)
    else:
        result = rank0.ToolChoice(mode=choice)
    try:
        check_tool_choice(result, names)
    except ValueError as exc:
        raise ConversionError(f"tool_choice: {exc}", "tool_choice") from None
    return result


def output_format(request: ResponsesRequest) -> rank0.OutputFormat | None:
    form = request.text.format if request.text else None
    if form is None or form.type == "text":
        return None
    if form.type == "json_object":
        return rank0.OutputFormat(type="json_object", param="text.format")
    if form.schema_ is None:
        raise ConversionError("text.format of type json_schema needs a schema", "text.format")
    return rank0.OutputFormat(
        type="json_schema", json_schema=form.schema_, param="text.format.schema"
    )


def turns(request: ResponsesRequest, history: list[rank0.ChatMessage]) -> list[rank0.ChatMessage]:
    """The conversation: the stored history, then the new items (no instructions)."""
    return history + conversation(parse_items(request.input))


def to_submit(
    request: ResponsesRequest, dialogue: list[rank0.ChatMessage], request_id: str, limits: Limits
) -> rank0.Submit:
    """Rank 0's request: the instructions as the system turn, then the conversation."""
    messages = list(dialogue)
    if request.instructions:
        messages.insert(0, rank0.ChatMessage(role="system", content=request.instructions))
    specs = [
        rank0.ToolSpec.of(t.name, t.description, t.parameters) for t in request.function_tools()
    ]
    effort = request.reasoning.effort if request.reasoning else None
    params = rank0.SamplingParams(
        max_tokens=limits.max_tokens(request.max_output_tokens),
        temperature=request.temperature,
        top_p=request.top_p,
    )
    return rank0.Submit(
        id=request_id,
        messages=messages,
        params=params,
        tools=specs,
        tool_choice=tool_choice(request, [spec.name for spec in specs]),
        parallel_tool_calls=request.parallel_tool_calls,
        output=output_format(request),
        enable_thinking=False if effort == "none" else None,
    )


def answer_turn(items: list[OutputItem]) -> rank0.ChatMessage:
    """The output as the assistant turn a continued conversation replays."""
    turn = rank0.ChatMessage(role="assistant")
    for item in items:
        if isinstance(item, OutputReasoning):
            turn.reasoning = "".join(part.text for part in item.content)
        elif isinstance(item, OutputMessage):
            turn.content = "".join(part.text for part in item.content)
        else:
            call = rank0.ToolCall(id=item.call_id, name=item.name, arguments=item.arguments)
            turn.tool_calls.append(call)
    return turn
