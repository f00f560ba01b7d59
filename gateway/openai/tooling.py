"""OpenAI's agent fields on the wire: tools, tool_choice, tool calls in requests and
responses, response_format; and their translation into what rank 0 takes (ipc.protocol).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from gateway.core import check_tool_choice
from gateway.errors import refused
from ipc.protocol import OutputFormat, ToolCall, ToolCallDelta, ToolChoice, ToolSpec

FUNCTION_NAME = r"^[a-zA-Z0-9_-]{1,64}$"


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class FunctionDef(_Lenient):
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(_Lenient):
    """A function tool (the only kind this server runs; custom tools are refused)."""

    type: Literal["function"] = "function"
    function: FunctionDef

    def to_spec(self) -> ToolSpec:
        function = self.function
        return ToolSpec.of(function.name, function.description, function.parameters)


class FunctionName(_Lenient):
    name: str = Field(pattern=FUNCTION_NAME)


class NamedToolChoice(_Lenient):
    type: Literal["function"] = "function"
    function: FunctionName


ToolChoiceParam = Literal["none", "auto", "required"] | NamedToolChoice


def tool_choice(choice: ToolChoiceParam | None) -> ToolChoice:
    if choice is None:
        return ToolChoice()
    if isinstance(choice, NamedToolChoice):
        return ToolChoice(mode="function", name=choice.function.name)
    return ToolChoice(mode=choice)


class CalledFunction(_Lenient):
    name: str
    arguments: str = Field(description="the arguments object as JSON text")


class RequestToolCall(_Lenient):
    """A call the assistant made earlier in the conversation."""

    id: str = Field(min_length=1, max_length=256)
    type: Literal["function"] = "function"
    function: CalledFunction

    def to_call(self) -> ToolCall:
        return ToolCall(id=self.id, name=self.function.name, arguments=self.function.arguments)


class JsonSchemaSpec(_Lenient):
    name: str = Field(default="response", max_length=64)
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class TextFormat(_Lenient):
    type: Literal["text"]


class JsonObjectFormat(_Lenient):
    type: Literal["json_object"]


class JsonSchemaFormat(_Lenient):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormat = Annotated[
    TextFormat | JsonObjectFormat | JsonSchemaFormat, Field(discriminator="type")
]


def output_format(response_format: ResponseFormat | None) -> OutputFormat | None:
    """What rank 0 enforces: nothing for text, else the JSON grammar."""
    if isinstance(response_format, JsonObjectFormat):
        return OutputFormat(type="json_object", param="response_format")
    if isinstance(response_format, JsonSchemaFormat):
        return OutputFormat(
            type="json_schema",
            json_schema=response_format.json_schema.schema_,
            param="response_format.json_schema.schema",
        )
    return None


class AgentFields(BaseModel):
    """The chat request's agent fields: tools, tool_choice, parallel_tool_calls,
    response_format, reasoning_effort (and the deprecated functions, refused)."""

    tools: list[ChatTool] | None = Field(default=None, max_length=128)
    tool_choice: ToolChoiceParam | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    reasoning_effort: str | None = Field(default=None, max_length=16)
    functions: list[Any] | None = None  # OpenAI's deprecated form of tools: refused
    function_call: Any = None

    _refuse_legacy_functions = field_validator("functions", "function_call")(
        refused(
            "functions and function_call are OpenAI's deprecated form; send the same "
            'functions as tools ([{"type": "function", "function": {...}}]) and '
            "function_call as tool_choice"
        )
    )

    @field_validator("tools")
    @classmethod
    def _check_tools(cls, tools: list[ChatTool] | None) -> list[ChatTool] | None:
        names = [tool.function.name for tool in tools or []]
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise ValueError(f"tool names must be unique; repeated: {', '.join(repeated)}")
        return tools

    @field_validator("tool_choice")
    @classmethod
    def _check_tool_choice(
        cls, value: ToolChoiceParam | None, info: ValidationInfo
    ) -> ToolChoiceParam | None:
        names = [tool.function.name for tool in info.data.get("tools") or []]
        check_tool_choice(tool_choice(value), names)
        return value

    def agent_fields(self) -> dict[str, Any]:
        """These fields as Submit's."""
        return {
            "tools": [tool.to_spec() for tool in self.tools or []],
            "tool_choice": tool_choice(self.tool_choice),
            "parallel_tool_calls": self.parallel_tool_calls is not False,
            "output": output_format(self.response_format),
            "enable_thinking": False if self.reasoning_effort == "none" else None,
        }


# ---- responses -----------------------------------------------------------------------


class ResponseFunction(BaseModel):
    name: str
    arguments: str


class ResponseToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ResponseFunction

    @classmethod
    def of(cls, call: ToolCall) -> ResponseToolCall:
        return cls(id=call.id, function=ResponseFunction(name=call.name, arguments=call.arguments))


class ChunkFunction(BaseModel):
    name: str | None = None
    arguments: str | None = None


class ChunkToolCall(BaseModel):
    """One piece of a streamed call: id, type and name only in the call's first piece
    (the SDK concatenates strings, so a repeated id would corrupt it)."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: ChunkFunction

    @classmethod
    def of(cls, piece: ToolCallDelta) -> ChunkToolCall:
        first = piece.id is not None
        return cls(
            index=piece.index,
            id=piece.id,
            type="function" if first else None,
            function=ChunkFunction(name=piece.name, arguments=piece.arguments),
        )
