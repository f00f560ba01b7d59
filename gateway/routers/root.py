"""GET /: what this service is, what it serves and its endpoints (JSON).

`service_info` builds the body; a browser page can later be served here for clients that
ask for HTML, with this JSON kept for everyone else.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

router = APIRouter(tags=["service"])


def endpoints(request: Request) -> list[dict[str, str]]:
    """Every documented route (the OpenAPI schema's): method, path and what it does."""
    found = []
    paths: dict[str, dict[str, Any]] = request.app.openapi().get("paths", {})
    for path, operations in paths.items():
        for method, operation in operations.items():
            text = (operation.get("description") or operation.get("summary") or "").strip()
            first = text.splitlines()[0] if text else ""
            found.append({"method": method.upper(), "path": path, "description": first})
    return found


def service_info(request: Request) -> dict[str, Any]:
    app = request.app
    client = app.state.rank_client
    now = client.availability()
    return {
        "name": "mlx-ring",
        "description": app.description,
        "version": app.version,
        "model": client.model_id,
        "status": now.state,
        "ready": now.http_status == 200,
        "openai_base_url": str(request.base_url) + "v1",
        "anthropic_base_url": str(request.base_url).rstrip("/"),
        "docs": "/docs",
        "endpoints": endpoints(request),
    }


@router.get("/")
async def root(request: Request) -> dict[str, Any]:
    """This service: name, version, served model, state and every endpoint."""
    return service_info(request)
