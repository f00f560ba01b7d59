"""Anthropic Messages wire formats: request bodies (content blocks, tools, tool_choice,
thinking, output_config) and the response. What rank 0 takes is made from these by
gateway/anthropic/convert.py; tool_choice is mapped here too, to be checked against the
tools while the body is parsed.

Unknown fields are ignored (clients send many: metadata, cache_control, service_tier...).
Content the server cannot run (images, documents, server tools) is refused by name.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from gateway.core import check_tool_choice
from ipc.protocol import ToolChoice

TOOL_NAME = r"^[a-zA-Z0-9_-]{1,64}$"


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class TextBlock(_Lenient):
    type: Literal["text"]
    text: str


class ToolUseBlock(_Lenient):
    type: Literal["tool_use"]
    id: str = Field(min_length=1, max_length=256)
    name: str
    input: dict[str, Any] = Field(default_factory=dict)


class ToolResultBlock(_Lenient):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1, max_length=256)
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None

    def text(self) -> str:
        content = self.content or ""
        body = content if isinstance(content, str) else "\n".join(b.text for b in content)
        return f"Error: {body}" if self.is_error else body


class ThinkingBlock(_Lenient):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Lenient):
    type: Literal["redacted_thinking"]


Block = Annotated[
    TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
    Field(discriminator="type"),
]
_RUNNABLE = {"text", "tool_use", "tool_result", "thinking", "redacted_thinking"}


def _refuse_other_blocks(value: Any) -> Any:
    """A clear 400 for block types the server cannot run, before the union says less."""
    if isinstance(value, list):
        for block in value:
            kind = block.get("type") if isinstance(block, dict) else None
            if isinstance(kind, str) and kind not in _RUNNABLE:
                raise ValueError(
                    f"content blocks of type {kind!r} are not supported by this server "
                    "(text-only model); send text, tool_use and tool_result blocks"
                )
    return value


class MessageParam(_Lenient):
    role: Literal["user", "assistant", "system"]
    content: str | list[Block]

    _check_blocks = field_validator("content", mode="before")(_refuse_other_blocks)


class SystemText(_Lenient):
    type: Literal["text"] = "text"
    text: str


class Tool(_Lenient):
    """A client tool. Server tools (web search, code execution...) have a versioned type
    and no input_schema: this server cannot run them."""

    type: str | None = None
    name: str = Field(pattern=TOOL_NAME)
    description: str | None = None
    input_schema: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _client_tool(self) -> Tool:
        if self.type not in (None, "custom") or self.input_schema is None:
            raise ValueError(
                f"tool {self.name!r} is a server tool (type {self.type!r}) or has no "
                "input_schema; this server runs only client tools with an input_schema"
            )
        return self


class ToolChoiceParam(_Lenient):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    def to_choice(self) -> ToolChoice:
        if self.type == "tool":
            return ToolChoice(mode="function", name=self.name)
        return ToolChoice(mode={"auto": "auto", "any": "required", "none": "none"}[self.type])


class ThinkingConfig(_Lenient):
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: int | None = None


class JsonSchemaOutput(_Lenient):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Lenient):
    format: JsonSchemaOutput | None = None


class Conversation(_Lenient):
    """What /v1/messages and /v1/messages/count_tokens share: the prompt."""

    model: str | None = Field(default=None, min_length=1, max_length=512)
    messages: list[MessageParam] = Field(min_length=1)
    system: str | list[SystemText] | None = None
    tools: list[Tool] | None = Field(default=None, max_length=128)
    tool_choice: ToolChoiceParam | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None

    @field_validator("tool_choice")
    @classmethod
    def _check_tool_choice(
        cls, value: ToolChoiceParam | None, info: ValidationInfo
    ) -> ToolChoiceParam | None:
        if value is not None:
            names = [tool.name for tool in info.data.get("tools") or []]
            check_tool_choice(value.to_choice(), names)
        return value


class MessagesRequest(Conversation):
    """POST /v1/messages."""

    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = Field(default=None, max_length=16)
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0, le=100_000)

    @field_validator("stop_sequences")
    @classmethod
    def _check_stops(cls, value: list[str] | None) -> list[str] | None:
        if value and any(not stop for stop in value):
            raise ValueError("stop sequences must not be empty strings")
        return value


class CountTokensRequest(Conversation):
    """POST /v1/messages/count_tokens: the prompt /v1/messages would run, counted."""


# ---- responses -----------------------------------------------------------------------

StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class AnthropicUsage(BaseModel):
    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


class MessageResponse(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[dict[str, Any]]
    stop_reason: StopReason | None
    stop_sequence: str | None = None
    usage: AnthropicUsage


class TokenCount(BaseModel):
    input_tokens: int
