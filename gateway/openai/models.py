"""GET /v1/models and GET /v1/models/{model}."""

from __future__ import annotations

from fastapi import APIRouter, Request

from gateway.core import served_model
from gateway.openai.protocol import ModelCard, ModelList, error_responses

router = APIRouter(tags=["models"])  # API_KEY: gateway/auth.ApiKeyGate


@router.get("/v1/models", response_model=ModelList, responses=error_responses(401, 503))
async def list_models(request: Request) -> ModelList:
    """The one served model (known once rank 0 has been reached)."""
    state = request.app.state
    model_id = served_model(state.rank_client, "default")
    return ModelList(data=[ModelCard(id=model_id, created=state.started_at)])


@router.get(
    "/v1/models/{model:path}", response_model=ModelCard, responses=error_responses(401, 404, 503)
)
async def get_model(model: str, request: Request) -> ModelCard:
    """The served model if `model` names it (id or alias), else 404."""
    state = request.app.state
    return ModelCard(id=served_model(state.rank_client, model), created=state.started_at)
