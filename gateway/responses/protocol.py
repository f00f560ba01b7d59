"""OpenAI Responses API wire formats (POST /v1/responses): the request, its input items, and
the response object with its output items and usage. Wire types only: gateway/responses/
convert.py turns them into what rank 0 takes, and rank 0's answer back into output items.

Unknown fields are ignored (Codex and the SDKs send many: include, prompt_cache_key,
client_metadata, service_tier, truncation, ...). Tools other than functions (web_search,
namespace, mcp, file_search, ...) are run by OpenAI's own service; here they are ignored.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from gateway.errors import refused
from gateway.openai.protocol import Performance
from gateway.openai.tooling import FUNCTION_NAME
from ipc.protocol import PromptTokensDetails, Usage


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class ContentPart(_Lenient):
    """A part of a message's content: input_text, output_text (the text kinds), or a kind
    this server cannot show a text model (input_image, input_file, ...)."""

    type: str
    text: str | None = None


class MessageItem(_Lenient):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]


class FunctionCallItem(_Lenient):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1, max_length=256)
    name: str
    arguments: str = ""


class FunctionCallOutputItem(_Lenient):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1, max_length=256)
    output: str | list[ContentPart]


class ReasoningPart(_Lenient):
    type: str = "reasoning_text"
    text: str = ""


class ReasoningItem(_Lenient):
    """Earlier reasoning passed back (Codex sends its items back every turn)."""

    type: Literal["reasoning"]
    summary: list[ReasoningPart] = Field(default_factory=list)
    content: list[ReasoningPart] | None = None


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem
ITEM_TYPES: dict[str, type[InputItem]] = {
    "message": MessageItem,
    "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem,
    "reasoning": ReasoningItem,
}


class FunctionTool(_Lenient):
    type: Literal["function"]
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionChoice(_Lenient):
    type: Literal["function"]
    name: str = Field(pattern=FUNCTION_NAME)


class TextFormatParam(_Lenient):
    """text.format: plain text, any JSON object, or JSON that matches `schema`."""

    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextParam(_Lenient):
    format: TextFormatParam | None = None


class ReasoningParam(_Lenient):
    effort: str | None = Field(default=None, max_length=16)  # accepted; "none" turns it off
    summary: str | None = None


# The request's settings a response repeats under the same names.
_ECHOED = (
    "instructions",
    "max_output_tokens",
    "parallel_tool_calls",
    "previous_response_id",
    "reasoning",
    "store",
    "temperature",
    "top_p",
    "text",
    "user",
)


class ResponsesRequest(_Lenient):
    """POST /v1/responses."""

    model: str | None = Field(default=None, min_length=1, max_length=512)
    input: str | list[dict[str, Any]] = Field(min_length=1)
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = Field(default=None, max_length=256)
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool = True
    text: TextParam | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    reasoning: ReasoningParam | None = None
    store: bool = True
    previous_response_id: str | None = Field(default=None, max_length=256)
    stream: bool = False
    metadata: dict[str, str] | None = None
    user: str | None = Field(default=None, max_length=256)
    conversation: Any = None  # OpenAI's stored conversations: not kept here

    _refuse_conversation = field_validator("conversation")(
        refused(
            "conversations are not stored by this server; continue a conversation with "
            "previous_response_id, or send the whole history as input items"
        )
    )

    def response_shell(self, response_id: str, model_id: str) -> Response:
        """The response this request opens, in progress: its settings echoed back, as
        OpenAI's responses carry them."""
        return Response(
            id=response_id,
            created_at=int(time.time()),
            status="in_progress",
            model=model_id,
            tool_choice=self.tool_choice or "auto",
            tools=[tool.model_dump(exclude_none=True) for tool in self.function_tools()],
            metadata=self.metadata or {},
            **{name: getattr(self, name) for name in _ECHOED},
        )

    def function_tools(self) -> list[FunctionTool]:
        """The tools the model may call: the function tools (others are ignored)."""
        tools = self.tools or []
        return [FunctionTool.model_validate(t) for t in tools if t.get("type") == "function"]


# ---- the response ---------------------------------------------------------------------


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    status: Literal["in_progress", "completed", "incomplete"] = "completed"
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class OutputFunctionCall(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class OutputReasoning(BaseModel):
    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText]


OutputItem = OutputMessage | OutputFunctionCall | OutputReasoning


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: PromptTokensDetails  # the same field as chat completions'
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int

    @classmethod
    def of(cls, usage: Usage) -> ResponseUsage:
        return cls(
            input_tokens=usage.prompt_tokens,
            input_tokens_details=usage.prompt_tokens_details,
            output_tokens=usage.completion_tokens,
            total_tokens=usage.total_tokens,
        )


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


ResponseStatus = Literal["in_progress", "completed", "incomplete", "failed"]


class Response(BaseModel):
    """The response object: returned whole, carried by stream events, kept for GET."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: ResponseStatus
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    error: dict[str, Any] | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: ReasoningParam | None = None
    store: bool = True
    temperature: float | None = None
    top_p: float | None = None
    text: TextParam | None = None
    tool_choice: Any = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    metadata: dict[str, str] = Field(default_factory=dict)
    user: str | None = None
    usage: ResponseUsage | None = None
    performance: Performance | None = None  # this server's figures, as in chat completions


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response"] = "response"
    deleted: bool = True
