"""Messages between api.py (client) and rank 0 (server) over the Unix socket.

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

from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

PROTOCOL_VERSION = 1
MAX_FRAME_BYTES = 8 * 1024 * 1024
HEADER_BYTES = 4


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ---- shared pieces -------------------------------------------------------------------


class SamplingParams(BaseModel):
    """Per-request decoding parameters, already validated by the API."""

    model_config = ConfigDict(extra="forbid")

    max_tokens: int = Field(ge=1)
    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    seed: int | None = None
    stop: list[str] = Field(default_factory=list)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = Field(default=1.0, gt=0.0)
    logprobs: bool = False
    top_logprobs: int = Field(default=0, ge=0, le=20)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant"]
    content: str


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


# Why a request ended: EOS or a stop string, max_tokens, or cancelled at rank 0.
FinishReason = Literal["stop", "length", "cancelled"]


class RankState(StrEnum):
    """Rank 0's state. The gateway maps each to an HTTP status and Retry-After."""

    LOADING = "loading"  # resolving, planning or loading the model
    READY = "ready"  # serving requests
    STOPPING = "stopping"  # a shutdown was asked for; no new requests
    FAILED = "failed"  # cannot serve; Status.reason says why


class Timings(BaseModel):
    """Measured by rank 0 for one request."""

    time_to_first_token_s: float
    prompt_tokens_per_second: float
    generation_tokens_per_second: float
    total_time_s: float


# ---- client -> server ----------------------------------------------------------------


class Hello(_Message):
    type: Literal["hello"] = "hello"
    protocol_version: int
    client: str = "api"


class Submit(_Message):
    """A generation request. Exactly one of `messages` (chat) or `prompt` (completion)."""

    type: Literal["submit"] = "submit"
    id: str = Field(min_length=1, max_length=128)
    messages: list[ChatMessage] | None = None
    prompt: str | None = None
    params: SamplingParams


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


class Started(_Message):
    """The request passed rank 0's checks and is queued; carries the prompt token count."""

    type: Literal["started"] = "started"
    id: str
    prompt_tokens: int


class Delta(_Message):
    """New text for one request. `text` never ends in the middle of a UTF-8 character."""

    type: Literal["delta"] = "delta"
    id: str
    text: str
    token_ids: list[int] = Field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None


class Done(_Message):
    type: Literal["done"] = "done"
    id: str
    finish_reason: FinishReason
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


class RankStatus(BaseModel):
    rank: int
    host: str
    share: str = ""
    weight_bytes: int = 0
    memory_bytes: int = 0
    machine_memory_bytes: int = 0  # its machine's memory (shared by the ranks on it)
    kv_bytes_per_token: int = 0  # this rank's KV per cached token; 0: no prefix cache
    prefix_cache_bytes: int = 0  # this rank's prefix-cache budget


class PrefixCacheStats(BaseModel):
    """The prefix cache as rank 0 sees it (bytes are rank 0's own)."""

    enabled: bool = False
    budget_tokens: int = 0
    entries: int = 0
    cached_tokens: int = 0
    bytes: int = 0
    hits: int = 0
    hit_tokens: int = 0
    misses: int = 0
    evictions: int = 0


class LoadProgress(BaseModel):
    """How far one rank is in loading its part: layers materialized of its total."""

    rank: int
    done: int
    total: int


class Counters(BaseModel):
    """Rank 0's running totals since it started (rates come from their differences)."""

    steps: int = 0
    decode_tokens: int = 0
    prefill_tokens: int = 0


class Status(_Message):
    """Rank 0's view of the cluster, for /health, /model/info and /cluster/status."""

    type: Literal["status"] = "status"
    state: RankState
    reason: str = ""
    model_id: str
    model_info: dict[str, Any] = Field(default_factory=dict)
    backend: str = ""
    world_size: int = 1
    plan: dict[str, Any] = Field(default_factory=dict)
    ranks: list[RankStatus] = Field(default_factory=list)
    active_requests: int = 0
    queued_requests: int = 0
    max_batch_size: int = 0
    last_step_ms: float | None = None
    counters: Counters = Field(default_factory=Counters)
    kv_tokens: int = 0  # tokens in the running batch's KV cache (on every rank)
    loading: list[LoadProgress] = Field(default_factory=list)  # per rank, while loading
    prefix_cache: PrefixCacheStats = Field(default_factory=PrefixCacheStats)
    max_sequence_length: int = 0
    uptime_s: float = 0.0


ClientMessage = Annotated[
    Hello | Submit | Cancel | StatusRequest | Shutdown, Field(discriminator="type")
]
ServerMessage = Annotated[
    Welcome | Started | Delta | Done | Error | Status, Field(discriminator="type")
]
CLIENT_MESSAGE: TypeAdapter[ClientMessage] = TypeAdapter(ClientMessage)
SERVER_MESSAGE: TypeAdapter[ServerMessage] = TypeAdapter(ServerMessage)
