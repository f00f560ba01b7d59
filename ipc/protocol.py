"""Messages between api.py (client) and rank 0 (server) over the Unix socket.

The status snapshot that answers StatusRequest (Status and its parts) lives in ipc/status.py.

Framing: each frame is a 4-byte big-endian length, then that many bytes of UTF-8 JSON
holding one message. One connection carries many requests at once, multiplexed by
request `id`; the API keeps one connection open and reconnects when it drops.

The client's first frame must be `Hello` with PROTOCOL_VERSION; the server answers
`Welcome` (or `Error` with code "protocol_version" and closes). A frame over
MAX_FRAME_BYTES or one that is not a valid message closes that connection after an
`Error` frame; other connections and requests are not touched. Closing a connection
cancels every request it submitted.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from ipc.status import Status

PROTOCOL_VERSION = 2  # 2: tools, output formats, reasoning, model aliases
MAX_FRAME_BYTES = 8 * 1024 * 1024
HEADER_BYTES = 4


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ---- shared pieces -------------------------------------------------------------------


class SamplingParams(BaseModel):
    """Per-request decoding parameters, already validated by the API. None: the served
    model's default (its generation_config.json, else DEFAULT_TEMPERATURE and friends),
    which rank 0 fills in."""

    model_config = ConfigDict(extra="forbid")

    max_tokens: int = Field(ge=1)
    temperature: float | None = Field(default=None, ge=0.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    seed: int | None = None
    stop: list[str] = Field(default_factory=list)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = Field(default=1.0, gt=0.0)
    logprobs: bool = False
    top_logprobs: int = Field(default=0, ge=0, le=20)


class ToolCall(BaseModel):
    """One function call: in an assistant message of the history, or parsed from the answer."""

    model_config = ConfigDict(extra="forbid")

    id: str
    name: str
    arguments: str  # the arguments object as JSON text


class ToolCallDelta(BaseModel):
    """A piece of the answer's `index`-th call: the first piece carries id and name, every
    piece appends to the arguments' JSON text (OpenAI's streaming shape)."""

    model_config = ConfigDict(extra="forbid")

    index: int = Field(ge=0)
    id: str | None = None
    name: str | None = None
    arguments: str = ""


class ChatMessage(BaseModel):
    """One turn of a conversation. Assistant turns may carry earlier reasoning and tool
    calls; a `tool` turn is the result of the call `tool_call_id`."""

    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    reasoning: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)
    tool_call_id: str | None = None
    name: str | None = None  # a tool turn: the function that produced it


class ToolSpec(BaseModel):
    """A function the model may call; `parameters` is a JSON schema of its arguments."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=64)
    description: str = ""
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})

    @classmethod
    def of(cls, name: str, description: str | None, parameters: dict[str, Any] | None) -> ToolSpec:
        """A tool as an API names it: no description is "", no schema takes no arguments."""
        spec = cls(name=name, description=description or "")
        if parameters is not None:
            spec.parameters = parameters
        return spec


class ToolChoice(BaseModel):
    """Whether the model may (auto), must not (none) or must (required, or the function
    `name`) call a tool. Forced calls are enforced by a grammar on rank 0."""

    model_config = ConfigDict(extra="forbid")

    mode: Literal["auto", "none", "required", "function"] = "auto"
    name: str | None = None


class OutputFormat(BaseModel):
    """A grammar the answer must follow: any JSON object, or one matching `json_schema`.
    `param` is the request field it came from, named in errors."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None
    param: str = "response_format"


class TopLogprob(BaseModel):
    """One alternative token: its text, log-probability and raw bytes (OpenAI's fields)."""

    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    """The sampled token and the most likely alternatives (OpenAI's `logprobs.content`)."""

    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class PromptTokensDetails(BaseModel):
    """Of the prompt tokens, how many came from the prefix cache (OpenAI's field)."""

    cached_tokens: int = 0


class Usage(BaseModel):
    """Token counts of one request (OpenAI's field names)."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


# Why a request ended: EOS or a stop string, the answer is tool calls, max_tokens, or
# cancelled at rank 0.
FinishReason = Literal["stop", "tool_calls", "length", "cancelled"]


class Timings(BaseModel):
    """Measured by rank 0 for one request."""

    time_to_first_token_s: float
    prompt_tokens_per_second: float
    generation_tokens_per_second: float
    total_time_s: float
    # speculative decoding (leader/speculation.py): tokens proposed for this answer, those
    # accepted, and the decode steps that gave it tokens (its tokens per step)
    proposed_tokens: int = 0
    accepted_tokens: int = 0
    decode_steps: int = 0


# ---- client -> server ----------------------------------------------------------------


class Hello(_Message):
    type: Literal["hello"] = "hello"
    protocol_version: int
    client: str = "api"


class Submit(_Message):
    """A generation request. Exactly one of `messages` (chat) or `prompt` (completion).

    Chats may offer `tools` (shown through the model's chat template, or a fallback prompt
    when the template has no tool format) and constrain the answer (`tool_choice` required
    or a function, `output`). `enable_thinking` None leaves the template's default.
    `continue_final_message`: a final assistant turn is a prefill the answer continues.
    `count_only`: render and count the prompt, answer Started then Done, generate nothing.
    """

    type: Literal["submit"] = "submit"
    id: str = Field(min_length=1, max_length=128)
    messages: list[ChatMessage] | None = None
    prompt: str | None = None
    params: SamplingParams
    tools: list[ToolSpec] = Field(default_factory=list)
    tool_choice: ToolChoice = Field(default_factory=ToolChoice)
    parallel_tool_calls: bool = True
    output: OutputFormat | None = None
    enable_thinking: bool | None = None
    continue_final_message: bool = False  # the answer continues the last (assistant) turn
    count_only: bool = False


class Cancel(_Message):
    type: Literal["cancel"] = "cancel"
    id: str


class StatusRequest(_Message):
    type: Literal["status"] = "status"


class Shutdown(_Message):
    """Ask rank 0 to end every rank cleanly (exit 0)."""

    type: Literal["shutdown"] = "shutdown"


# ---- server -> client ----------------------------------------------------------------


class Welcome(_Message):
    type: Literal["welcome"] = "welcome"
    protocol_version: int
    model_id: str
    model_aliases: list[str] = Field(default_factory=list)


class Started(_Message):
    """The request passed rank 0's checks and is queued; carries the prompt token count."""

    type: Literal["started"] = "started"
    id: str
    prompt_tokens: int


class Delta(_Message):
    """New output of one request: answer text, reasoning text (inside the model's thinking
    markers) and pieces of tool calls. Text never ends in the middle of a UTF-8 character."""

    type: Literal["delta"] = "delta"
    id: str
    text: str
    reasoning: str = ""
    tool_calls: list[ToolCallDelta] = Field(default_factory=list)
    token_ids: list[int] = Field(default_factory=list)
    accepted: int = 0  # of token_ids (the first ones), proposals speculation accepted
    logprobs: list[TokenLogprob] | None = None


class Done(_Message):
    type: Literal["done"] = "done"
    id: str
    finish_reason: FinishReason
    stop_sequence: str | None = None  # the stop string that ended the answer
    usage: Usage
    timings: Timings


ErrorCode = Literal[
    "protocol_version",
    "bad_frame",
    "invalid_request",
    "prompt_too_long",
    "duplicate_id",
    "loading",
    "shutting_down",
    "internal",
]


class Error(_Message):
    """An error for one request (`id` set) or for the connection (`id` None)."""

    type: Literal["error"] = "error"
    id: str | None = None
    code: ErrorCode
    message: str
    param: str | None = None  # the request field at fault, when one is


ClientMessage = Annotated[
    Hello | Submit | Cancel | StatusRequest | Shutdown, Field(discriminator="type")
]
ServerMessage = Annotated[
    Welcome | Started | Delta | Done | Error | Status, Field(discriminator="type")
]
CLIENT_MESSAGE: TypeAdapter[ClientMessage] = TypeAdapter(ClientMessage)
SERVER_MESSAGE: TypeAdapter[ServerMessage] = TypeAdapter(ServerMessage)
