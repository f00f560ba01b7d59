"""Anthropic Messages requests (gateway/anthropic/protocol.py) as the message rank 0 takes
(ipc.protocol `Submit`): the system prompt and content blocks as chat turns, tools,
tool_choice, thinking, output_config, and the answer's cap (gateway.core.Limits). The
routes (gateway/anthropic/messages.py) call these."""

from __future__ import annotations

import json
from typing import Any

from gateway.anthropic.protocol import (
    Conversation,
    CountTokensRequest,
    MessageParam,
    MessagesRequest,
    SystemText,
    TextBlock,
    ThinkingBlock,
    Tool,
    ToolResultBlock,
    ToolUseBlock,
)
from gateway.core import Limits
from ipc.protocol import (
    ChatMessage,
    OutputFormat,
    SamplingParams,
    Submit,
    ToolCall,
    ToolChoice,
    ToolSpec,
)


def message_submit(body: MessagesRequest, request_id: str, limits: Limits) -> Submit:
    """POST /v1/messages as rank 0's Submit."""
    params = SamplingParams(
        max_tokens=limits.max_tokens(body.max_tokens),
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        stop=body.stop_sequences or [],
    )
    return Submit(id=request_id, params=params, **submit_fields(body))


def count_submit(body: CountTokensRequest, request_id: str) -> Submit:
    """POST /v1/messages/count_tokens as rank 0's Submit: render and count, generate nothing."""
    params = SamplingParams(max_tokens=1)
    return Submit(id=request_id, params=params, count_only=True, **submit_fields(body))


def submit_fields(body: Conversation) -> dict[str, Any]:
    """What /v1/messages and /v1/messages/count_tokens both send: the prompt and its tools."""
    choice = body.tool_choice.to_choice() if body.tool_choice else ToolChoice()
    output = None
    if body.output_config and body.output_config.format:
        schema = body.output_config.format.schema_
        output = OutputFormat(
            type="json_schema", json_schema=schema, param="output_config.format.schema"
        )
    thinking = None
    if body.thinking is not None:
        thinking = body.thinking.type != "disabled"
    parallel = not (body.tool_choice and body.tool_choice.disable_parallel_tool_use)
    return {
        "messages": chat_messages(body),
        "tools": [tool_spec(tool) for tool in body.tools or []],
        "tool_choice": choice,
        "parallel_tool_calls": parallel,
        "output": output,
        "enable_thinking": thinking,
        "continue_final_message": body.messages[-1].role == "assistant",  # a prefill
    }


def tool_spec(tool: Tool) -> ToolSpec:
    return ToolSpec.of(tool.name, tool.description, tool.input_schema or {})


# Claude Code opens its system prompt with a block such as "x-anthropic-billing-header:
# cc_version=2.1.332.4f9; cc_entrypoint=sdk-cli;", whose suffix changes with each session's
# first prompt: billing metadata for Anthropic's API, meaning nothing to a local model.
# Rendered, it split every new session from the last at its 25th token, and each session
# prefilled its 12.5K-token prompt again (docs/ARCHITECTURE.md, "What the model sees").
BILLING_HEADER = "x-anthropic-billing-header:"


def chat_messages(body: Conversation) -> list[ChatMessage]:
    """The conversation as rank 0's messages: the system prompt first (without a billing
    header); tool results become tool turns, tool_use blocks the assistant's calls,
    thinking its reasoning."""
    out: list[ChatMessage] = []
    text = system_text(body.system)
    if text:
        out.append(ChatMessage(role="system", content=text))
    for message in body.messages:
        out += _turns(message)
    return out


def system_text(system: str | list[SystemText] | None) -> str:
    """The system prompt the model sees: its blocks joined by newlines, each less a first
    line that is a billing header (a block that was only that line is left out)."""
    if not system:
        return ""
    texts = [system] if isinstance(system, str) else [block.text for block in system]
    kept = [_without_billing_header(text) for text in texts]
    return "\n".join(text for text in kept if text is not None)


def _without_billing_header(text: str) -> str | None:
    """`text` less its first line where that is a billing header; None if nothing is left."""
    first, _, rest = text.lstrip().partition("\n")
    if not first.startswith(BILLING_HEADER):
        return text
    return rest if rest.strip() else None


def _turns(message: MessageParam) -> list[ChatMessage]:
    if isinstance(message.content, str):
        return [ChatMessage(role=message.role, content=message.content)]
    texts = [b.text for b in message.content if isinstance(b, TextBlock)]
    if message.role == "assistant":
        calls = [
            ToolCall(id=b.id, name=b.name, arguments=json.dumps(b.input, ensure_ascii=False))
            for b in message.content
            if isinstance(b, ToolUseBlock)
        ]
        thoughts = [b.thinking for b in message.content if isinstance(b, ThinkingBlock)]
        reasoning = "\n".join(thoughts) or None
        turn = ChatMessage(role="assistant", content="".join(texts), reasoning=reasoning)
        turn.tool_calls = calls
        return [turn]
    out = [
        ChatMessage(role="tool", content=b.text(), tool_call_id=b.tool_use_id)
        for b in message.content
        if isinstance(b, ToolResultBlock)
    ]
    if texts or not out:
        out.append(ChatMessage(role=message.role, content="\n".join(texts)))
    return out
