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


def service_info(request: Request) -> dict[str, Any]:
    """What this server is and what it serves (the JSON answer at `GET /`)."""
    app: FastAPI = request.app
    client = app.state.rank_client
    paths = sorted(app.openapi().get("paths", {}))
    return {
        "service": app.title,
        "version": app.version,
        "model": client.model_id,
        "state": client.availability().state,
        "dashboard": "/dashboard",
        "endpoints": paths,
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
