"""create_app(settings): the FastAPI app, its rank-0 client, routers and error handlers."""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI

from config.settings import Settings
from gateway import dashboard
from gateway.anthropic import errors as anthropic_errors
from gateway.anthropic import messages
from gateway.auth import ApiKeyGate
from gateway.errors import install_error_handlers
from gateway.middleware import AccessLog, BodyLimit
from gateway.openai import chat, completions, models
from gateway.rank_client import RankClient
from gateway.responses import routes as responses
from gateway.responses.store import ResponseStore
from gateway.routers import health, info, metrics
from gateway.telemetry import Telemetry
from ipc.supervisor_state import STATE_ENV, StateReader


def create_app(settings: Settings) -> FastAPI:
    """Build the app; the rank-0 connection starts with the app's lifespan."""
    state_file = os.environ.get(STATE_ENV)
    supervisor = StateReader(Path(state_file)) if state_file else None
    client = RankClient(settings.socket_path, supervisor=supervisor)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        client.start()
        try:
            yield
        finally:
            await client.close()

    app = FastAPI(
        title="MLX ring inference",
        description="OpenAI- and Anthropic-compatible API in front of an MLX distributed cluster.",
        version="0.1.0",
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.rank_client = client
    telemetry = Telemetry()
    client.on_status = telemetry.observe
    app.state.telemetry = telemetry
    app.state.metrics = metrics.Metrics(
        lambda: client.status.prefix_cache if client.status is not None else None,
        telemetry.rates,
        lambda: client.status.speculation if client.status is not None else None,
    )
    app.state.responses = ResponseStore(settings.response_store_bytes)
    app.state.started_at = int(time.time())
    app.state.error_shapes = [(anthropic_errors.PREFIX, anthropic_errors.error_response)]
    apis = (chat, completions, messages, responses, models)
    for module in (*apis, health, info, metrics, dashboard):
        app.include_router(module.router)
    dashboard.mount_static(app)
    install_error_handlers(app)
    app.add_middleware(BodyLimit, max_bytes=settings.max_request_bytes)
    # outside BodyLimit: no key, no body read (the last added runs first)
    app.add_middleware(ApiKeyGate, api_key=settings.api_key)
    app.add_middleware(AccessLog, metrics=app.state.metrics)
    return app
