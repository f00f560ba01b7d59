"""The dashboard: `GET /` in a browser, its static page, and the JSON it polls.

The page (static/, no build step, nothing from a CDN) polls /dashboard/state every two
seconds; that document is built from what api.py already holds, so an idle tab never
wakes the ranks. Clients that do not ask for HTML get the service info at `GET /`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles

from gateway.dashboard.state import DashboardState, dashboard_state

STATIC = Path(__file__).resolve().parent / "static"
router = APIRouter(tags=["dashboard"])


def wants_html(request: Request) -> bool:
    """A browser navigating to the page (Accept lists text/html)."""
    return "text/html" in request.headers.get("accept", "")


def endpoints(request: Request) -> list[dict[str, str]]:
    """Every documented route (the OpenAPI schema's): method, path and what it does."""
    found = []
    paths: dict[str, dict[str, Any]] = request.app.openapi().get("paths", {})
    for path, operations in sorted(paths.items()):
        for method, operation in operations.items():
            text = (operation.get("description") or operation.get("summary") or "").strip()
            first = text.splitlines()[0] if text else ""
            found.append({"method": method.upper(), "path": path, "description": first})
    return found


def service_info(request: Request) -> dict[str, Any]:
    """What this server is and what it serves (the JSON answer at `GET /`): the served
    model, its state, the base URLs for OpenAI and Anthropic clients, every endpoint."""
    app: FastAPI = request.app
    client = app.state.rank_client
    now = client.availability()
    base = str(request.base_url).rstrip("/")
    return {
        "service": app.title,
        "description": app.description,
        "version": app.version,
        "model": client.model_id,
        "state": now.state,
        "ready": now.http_status == 200,
        "openai_base_url": f"{base}/v1",
        "anthropic_base_url": base,
        "dashboard": "/dashboard",
        "docs": "/docs",
        "endpoints": endpoints(request),
    }


@router.get("/", include_in_schema=False)
async def root(request: Request) -> Response:
    """A browser gets the dashboard; API clients get the service info as JSON."""
    if wants_html(request):
        return FileResponse(STATIC / "index.html", media_type="text/html")
    return JSONResponse(service_info(request))


@router.get("/dashboard", include_in_schema=False)
async def page() -> FileResponse:
    return FileResponse(STATIC / "index.html", media_type="text/html")


@router.get("/dashboard/state", response_model=DashboardState)
async def state(request: Request) -> DashboardState:
    """Everything the dashboard shows, from cached state only (the ranks are never asked)."""
    app_state = request.app.state
    return dashboard_state(app_state.rank_client, app_state.telemetry)


def mount_static(app: FastAPI) -> None:
    app.mount("/dashboard/static", StaticFiles(directory=STATIC), name="dashboard-static")
