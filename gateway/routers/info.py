"""GET /model/info and GET /cluster/status, from rank 0's Status."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from gateway.errors import unavailable
from gateway.model_facts import model_facts
from gateway.openai.protocol import error_responses

router = APIRouter(tags=["cluster"])  # API_KEY: gateway/auth.ApiKeyGate


@router.get("/model/info", responses=error_responses(401, 503))
async def model_info(request: Request) -> dict[str, Any]:
    """The served model: id, architecture, parameters, quantization, context, ranks, plan."""
    client = request.app.state.rank_client
    status = await client.fetch_status()
    if status is None:
        now = client.availability()
        raise unavailable(f"The model is not known yet: {now.reason}.", now.retry_after or 2)
    info = status.model_info
    facts = model_facts(str(info["path"])) if info.get("path") else {}
    return {
        "id": status.model_id,
        "architecture": info.get("architecture")
        or facts.get("architecture")
        or info.get("model_type"),
        "parameters": info.get("parameters") or facts.get("parameters"),
        "quantization": info.get("quantization") or facts.get("quantization"),
        "context_length": status.max_sequence_length or info.get("context_length"),
        "ranks": status.world_size,
        "backend": status.backend,
        "plan": status.plan,
        "state": status.state,
        "details": info,
    }


@router.get("/cluster/status", responses=error_responses(401))
async def cluster_status(request: Request) -> dict[str, Any]:
    """Hosts, ranks (share, memory), backend, last step time, active requests.

    Answers 200 even when the ranks are down: `state` and `reason` say so, and `ranks`
    holds the last known report (`stale`: true) so an operator sees what went missing.
    `supervisor` (under launch.sh) holds its phase, restarts, failures and left-out workers.
    """
    client = request.app.state.rank_client
    status = await client.fetch_status()
    now = client.availability()
    supervisor = client.supervisor.read() if client.supervisor else None
    body: dict[str, Any] = {
        "state": now.state,
        "reason": now.reason,
        "supervisor": supervisor.model_dump() | {"summary": supervisor.summary()}
        if supervisor
        else None,
        "rank0_connected": client.connected,
        "socket_path": str(client.socket_path),
        "api_in_flight_requests": client.in_flight,
    }
    if status is None:
        return body | {"ranks": [], "hosts": []}
    ranks = [rank.model_dump() for rank in status.ranks]
    reported = {rank.rank for rank in status.ranks}
    return body | {
        "stale": not client.connected,
        "model": status.model_id,
        "backend": status.backend,
        "world_size": status.world_size,
        "hosts": sorted({rank.host for rank in status.ranks}),
        "ranks": ranks,
        "missing_ranks": [r for r in range(status.world_size) if r not in reported],
        "active_requests": status.active_requests,
        "queued_requests": status.queued_requests,
        "max_batch_size": status.max_batch_size,
        "last_step_ms": status.last_step_ms,
        "uptime_s": status.uptime_s,
        "prefix_cache": status.prefix_cache.model_dump(),
        "speculation": status.speculation.model_dump(),
        "plan": status.plan,
    }
