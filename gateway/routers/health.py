"""GET /health, /health/live, /health/ready."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

router = APIRouter(tags=["health"])


def _readiness(request: Request) -> tuple[bool, dict]:
    client = request.app.state.rank_client
    state, reason = client.health()
    status = client.status if client.connected else None
    body = {
        "status": state,
        "ready": state == "ready",
        "reason": reason,
        "model": client.model_id,
        "rank0_connected": client.connected,
        "world_size": status.world_size if status else None,
        "active_requests": status.active_requests if status else None,
    }
    return state == "ready", body


def _answer(ready: bool, body: dict) -> JSONResponse:
    headers = {} if ready else {"Retry-After": "5" if body["status"] == "loading" else "2"}
    return JSONResponse(body, status_code=200 if ready else 503, headers=headers)


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    """200 when the ranks serve requests; 503 with the reason otherwise."""
    return _answer(*_readiness(request))


@router.get("/health/ready")
async def ready(request: Request) -> JSONResponse:
    """Readiness probe: same judgement as /health."""
    return _answer(*_readiness(request))


@router.get("/health/live")
async def live() -> dict:
    """Liveness probe: 200 while this process answers, whatever the ranks do."""
    return {"status": "alive"}
