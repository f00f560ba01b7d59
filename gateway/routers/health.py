"""GET /health, /health/live, /health/ready."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

router = APIRouter(tags=["health"])


def _readiness(request: Request) -> JSONResponse:
    client = request.app.state.rank_client
    now = client.availability()
    status = client.status if client.connected else None
    supervisor = client.supervisor.read() if client.supervisor else None
    body = {
        "status": now.state,
        "ready": now.http_status == 200,
        "reason": now.reason,
        "model": client.model_id,
        "rank0_connected": client.connected,
        "world_size": status.world_size if status else None,
        "active_requests": status.active_requests if status else None,
        "supervisor": supervisor.summary() if supervisor else None,
    }
    headers = {"Retry-After": str(now.retry_after)} if now.retry_after else {}
    return JSONResponse(body, status_code=now.http_status, headers=headers)


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    """200 when the ranks serve requests; 503 with the reason otherwise."""
    return _readiness(request)


@router.get("/health/ready")
async def ready(request: Request) -> JSONResponse:
    """Readiness probe: same judgement as /health."""
    return _readiness(request)


@router.get("/health/live")
async def live() -> dict[str, Any]:
    """Liveness probe: 200 while this process answers, whatever the ranks do."""
    return {"status": "alive"}
