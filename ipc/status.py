"""Rank 0's status snapshot: the answer to a StatusRequest on the socket (ipc/protocol.py).

Read by the gateway (/health, /model/info, /cluster/status, the dashboard, /metrics) and by
the launcher (readiness, shutdown); written by rank 0 (leader/loop.py) from its running state.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class RankState(StrEnum):
    """Rank 0's state. The gateway maps each to an HTTP status and Retry-After."""

    LOADING = "loading"  # resolving, planning or loading the model
    WARMING = "warming"  # loaded; running the first forwards before ready (leader/warmup.py)
    READY = "ready"  # serving requests
    STOPPING = "stopping"  # a shutdown was asked for; no new requests
    FAILED = "failed"  # cannot serve; Status.reason says why


class RankStatus(BaseModel):
    rank: int
    host: str
    share: str = ""
    weight_bytes: int = 0
    memory_bytes: int = 0
    machine_memory_bytes: int = 0  # its machine's memory (shared by the ranks on it)
    kv_bytes_per_token: int = 0  # this rank's KV per cached token; 0: no prefix cache
    prefix_cache_bytes: int = 0  # this rank's prefix-cache budget
    # beyond weights, KV and prefix cache: decode traces, MLX's buffer cache, a step's
    # buffers (distributed/overhead.py)
    overhead_bytes: int = 0


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
    disk_entries: int = 0  # saved on disk (PREFIX_CACHE_DIR)
    disk_tokens: int = 0
    disk_loads: int = 0  # read back after eviction or a restart
    disk_load_failures: int = 0  # refused by a rank (missing, damaged): computed instead


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


class SpeculationStats(BaseModel):
    """Rank 0's speculative decoding (leader/speculation.py): whether it runs (or why not)
    and its totals since it started."""

    enabled: bool = False
    reason: str = ""  # why it is off
    spec_tokens: int = 0  # the most tokens proposed for a row in a step
    proposed_tokens: int = 0
    accepted_tokens: int = 0
    acceptance_rate: float = 0.0  # accepted / proposed
    tokens_per_step: float = 0.0  # tokens a decoding row took per step
    draft_model: str = ""  # DRAFT_MODEL in use (leader/draft_model.py); empty: none
    draft_reason: str = ""  # why DRAFT_MODEL is set but not used
    draft_proposed_tokens: int = 0  # of proposed_tokens, those the draft model proposed
    draft_accepted_tokens: int = 0


class StepModelStatus(BaseModel):
    """The step-time model's predictions for the running plan (distributed/step_model.py)
    beside rank 0's measured steps: medians of the last steps of each row count (decode
    steps without prefill; rows = requests x positions a row), each step predicted with its
    own context; prefill as tokens a second over the prefill-only steps of long prompts."""

    machines: list[str] = Field(default_factory=list)
    link: str = ""
    predicted_decode_ms: dict[int, float] = Field(default_factory=dict)
    measured_decode_ms: dict[int, float] = Field(default_factory=dict)
    decode_steps: dict[int, int] = Field(default_factory=dict)  # measured, by rows
    decode_context: dict[int, float] = Field(default_factory=dict)  # median positions a row
    predicted_prefill_tokens_per_s: float = 0.0
    measured_prefill_tokens_per_s: float = 0.0
    prefill_steps: int = 0
    # an expert split's busiest rank's share of the routes counted so far (0: none)
    expert_load: float = 0.0
    # what a prediction can be made again from (bench/step_model.py): the measured speed
    # (every rank's machine record and the link) and the last prefill steps' forwards
    speed: dict[str, Any] = Field(default_factory=dict)
    prefill_forwards: list[tuple[list[tuple[int, int]], float]] = Field(default_factory=list)


class Status(BaseModel):
    """Rank 0's view of the cluster, for /health, /model/info and /cluster/status."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["status"] = "status"
    state: RankState
    reason: str = ""
    model_id: str
    model_aliases: list[str] = Field(default_factory=list)  # other names that select it
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
    speculation: SpeculationStats = Field(default_factory=SpeculationStats)
    step_model: StepModelStatus = Field(default_factory=StepModelStatus)
    max_sequence_length: int = 0
    uptime_s: float = 0.0
    warm_up: str = ""  # what the warm-up before ready ran, and its time (empty: none ran)
