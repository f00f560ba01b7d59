"""The dashboard's one JSON document: the model, the plan, every rank with its memory, the
live series, recent requests and the prefix cache, all from what api.py already holds
(rank 0's last status, the telemetry it keeps, the model's files on this host)."""

from __future__ import annotations

import time
from typing import Any

from pydantic import BaseModel

from gateway.model_facts import model_facts
from gateway.rank_client import RankClient
from gateway.telemetry import RecentRequest, Sample, Telemetry
from ipc.status import LoadProgress, PrefixCacheStats, SpeculationStats, Status


class ModelView(BaseModel):
    id: str | None
    family: str | None
    parameters: int | None
    quantization: str | None
    context_length: int | None


class RankView(BaseModel):
    rank: int
    host: str | None
    up: bool  # reported by rank 0 and the ranks are connected
    share: str
    weight_bytes: int
    kv_bytes: int  # the running batch's KV on this rank
    cache_bytes: int  # the prefix cache on this rank
    machine_memory_bytes: int


class DashboardState(BaseModel):
    time: float
    state: str
    reason: str
    uptime_s: float | None
    model: ModelView
    plan: dict[str, Any]
    ranks: list[RankView]
    loading: list[LoadProgress]
    series: list[Sample]
    recent: list[RecentRequest]
    prefix_cache: PrefixCacheStats
    speculation: SpeculationStats
    hit_rate: float | None  # prompt tokens from the cache / prompt tokens of recent requests
    supervisor: dict[str, Any] | None


def _quantization(facts: dict[str, Any]) -> str | None:
    quant = facts.get("quantization") or {}
    if quant.get("bits"):
        return f"{quant['bits']}-bit (group {quant.get('group_size')})"
    return quant.get("dtype")


def _model(status: Status | None, client: RankClient) -> ModelView:
    info = status.model_info if status else {}
    facts = model_facts(str(info["path"])) if info.get("path") else {}
    return ModelView(
        id=client.model_id,
        family=info.get("model_type"),
        parameters=facts.get("parameters"),
        quantization=_quantization(facts),
        context_length=status.max_sequence_length if status else None,
    )


def _ranks(status: Status | None, connected: bool) -> list[RankView]:
    if status is None:
        return []
    views = []
    reported = {rank.rank: rank for rank in status.ranks}
    for index in range(status.world_size):
        rank = reported.get(index)
        per_token = rank.kv_bytes_per_token if rank else 0
        views.append(
            RankView(
                rank=index,
                host=rank.host if rank else None,
                up=connected and rank is not None and status.state == "ready",
                share=rank.share if rank else "",
                weight_bytes=rank.weight_bytes if rank else 0,
                kv_bytes=status.kv_tokens * per_token,
                cache_bytes=status.prefix_cache.cached_tokens * per_token,
                machine_memory_bytes=rank.machine_memory_bytes if rank else 0,
            )
        )
    return views


def _hit_rate(recent: list[RecentRequest]) -> float | None:
    prompt = sum(r.prompt_tokens for r in recent)
    return sum(r.cached_tokens for r in recent) / prompt if prompt else None


def _supervisor(client: RankClient) -> dict[str, Any] | None:
    """What the supervisor reports (ipc/supervisor_state.py), when one runs the ranks."""
    state = client.supervisor.read() if client.supervisor else None
    return state.model_dump() | {"summary": state.summary()} if state else None


def dashboard_state(client: RankClient, telemetry: Telemetry) -> DashboardState:
    """Everything the page shows, from cached state only (the ranks are never asked)."""
    status = client.status
    now = client.availability()
    recent = list(telemetry.recent)
    return DashboardState(
        time=time.time(),
        state=now.state,
        reason=now.reason,
        uptime_s=status.uptime_s if status else None,
        model=_model(status, client),
        plan=status.plan if status else {},
        ranks=_ranks(status, client.connected),
        loading=status.loading if status else [],
        series=list(telemetry.samples),
        recent=recent,
        prefix_cache=status.prefix_cache if status else PrefixCacheStats(),
        speculation=status.speculation if status else SpeculationStats(),
        hit_rate=_hit_rate(recent),
        supervisor=_supervisor(client),
    )
