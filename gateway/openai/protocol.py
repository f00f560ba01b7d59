"""OpenAI wire formats: request bodies, responses, streaming chunks, model lists, errors.

Only the wire: what rank 0 takes is made from these by gateway/openai/convert.py. Usage and
logprobs are rank 0's own types (ipc.protocol), and Performance wraps its Timings.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

from gateway.openai.tooling import (
    AgentFields,
    ChunkToolCall,
    RequestToolCall,
    ResponseToolCall,
)
from ipc.protocol import Timings, TokenLogprob, Usage

_INT64 = 2**63


class _Request(BaseModel):
    # Unknown fields are ignored (clients send vendor extras); NaN/inf are refused.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]
    text: str


class RequestMessage(BaseModel):
    """A chat message: string content or a list of text content parts. Assistant turns
    may carry tool calls (then content may be null) and earlier reasoning; a tool turn
    answers the call `tool_call_id`."""

    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[RequestToolCall] | None = None
    tool_call_id: str | None = Field(default=None, max_length=256)
    reasoning_content: str | None = None
    reasoning: str | None = None  # vLLM's and mlx_lm.server's name for the same

    @model_validator(mode="after")
    def _content_present(self) -> RequestMessage:
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content (a string or text parts)")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs tool_call_id: the id of the call it answers")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        return self

    def text(self) -> str:
        """The message content as one string (text parts joined by newlines)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


class _Sampling(_Request):
    """Fields shared by chat and text completions."""

    model: str | None = Field(default=None, min_length=1, max_length=512)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0, le=100_000)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=-_INT64, lt=_INT64)
    stop: str | list[str] | None = None
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=10.0)
    n: int = Field(default=1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(default=None, max_length=256)

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk (stream_options.include_usage)."""
        return bool(self.stream_options and self.stream_options.include_usage)

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else value or []
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences are allowed")
        if any(not stop for stop in stops):
            raise ValueError("stop sequences must not be empty strings")
        return value

    @field_validator("n")
    @classmethod
    def _check_n(cls, value: int) -> int:
        if value != 1:
            raise ValueError(
                f"n={value} is not supported: this server returns one choice per request; "
                "send n=1 and repeat the request for more choices"
            )
        return value

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class ChatCompletionRequest(_Sampling, AgentFields):
    """POST /v1/chat/completions."""

    messages: list[RequestMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)

    @model_validator(mode="after")
    def _check_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        return self


class CompletionRequest(_Sampling):
    """POST /v1/completions. One text prompt (a string, or a list holding one string)."""

    prompt: str | Annotated[list[str], Field(min_length=1, max_length=1)]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, value: str | list[str]) -> str | list[str]:
        text = value if isinstance(value, str) else value[0]
        if not text:
            raise ValueError("the prompt must not be empty")
        return value

    @model_validator(mode="after")
    def _check_unsupported(self) -> CompletionRequest:
        if self.echo:
            raise ValueError("echo=true is not supported by this server; leave it false")
        if self.suffix:
            raise ValueError("suffix is not supported by this server; leave it unset")
        return self

    def prompt_text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]


# ---- responses -----------------------------------------------------------------------


class Performance(BaseModel):
    """Rank 0's Timings of this request as the responses show them; times in seconds."""

    time_to_first_token: float = Field(description="seconds from arrival to first token")
    prompt_tokens_per_second: float
    generation_tokens_per_second: float
    total_time: float = Field(description="seconds from arrival to the last token")
    proposed_tokens: int = Field(0, description="speculative decoding: tokens proposed")
    accepted_tokens: int = Field(0, description="speculative decoding: proposals accepted")
    acceptance_rate: float = Field(0.0, description="accepted_tokens / proposed_tokens")
    tokens_per_step: float = Field(0.0, description="tokens per decode step after the first")

    @classmethod
    def of(cls, timings: Timings) -> Performance:
        proposed, accepted, steps = (
            timings.proposed_tokens,
            timings.accepted_tokens,
            timings.decode_steps,
        )
        return cls(
            time_to_first_token=round(timings.time_to_first_token_s, 6),
            prompt_tokens_per_second=round(timings.prompt_tokens_per_second, 3),
            generation_tokens_per_second=round(timings.generation_tokens_per_second, 3),
            total_time=round(timings.total_time_s, 6),
            proposed_tokens=proposed,
            accepted_tokens=accepted,
            acceptance_rate=round(accepted / proposed, 4) if proposed else 0.0,
            tokens_per_step=round((steps + accepted) / steps, 4) if steps else 0.0,
        )


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None
    refusal: list[TokenLogprob] | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


# What a choice reports: rank 0's reasons, less "cancelled" (a cancelled request gets an error).
ChoiceFinishReason = Literal["stop", "length", "tool_calls"]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ResponseToolCall] | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: ChoiceFinishReason


class ResponseHead(BaseModel):
    """What every completion response and chunk of one request repeats."""

    id: str
    created: int
    model: str
    system_fingerprint: str


class _Response(ResponseHead):
    usage: Usage | None = None
    performance: Performance | None = None


class ChatCompletion(_Response):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage
    performance: Performance


class ChunkDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ChunkToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChunkDelta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: ChoiceFinishReason | None = None


class ChatCompletionChunk(_Response):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]


class TextChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: ChoiceFinishReason | None = None


class TextCompletion(_Response):
    """A text completion, and (with finish_reason null) a streaming chunk of one."""

    object: Literal["text_completion"] = "text_completion"
    choices: list[TextChoice]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "mlx-ring"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


def error_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` entries for the given error statuses."""
    return {code: {"model": ErrorResponse} for code in codes}
