"""Server-sent events framing shared by the streaming routes."""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel

DONE = "data: [DONE]\n\n"
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _without_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(item) for item in value]
    return value


def event(payload: BaseModel | dict[str, Any], *, drop: tuple[str, ...] = ()) -> str:
    """One `data:` event; keys in `drop` are left out of the top-level object, and null
    fields out of stream deltas (a delta carries only what changed)."""
    data = payload.model_dump(mode="json") if isinstance(payload, BaseModel) else dict(payload)
    for key in drop:
        data.pop(key, None)
    for choice in data.get("choices") or []:
        if isinstance(choice.get("delta"), dict):
            choice["delta"] = _without_nulls(choice["delta"])
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"


def named_event(name: str, payload: BaseModel | dict[str, Any]) -> str:
    """One `event: <name>` + `data:` event (Anthropic's stream: the SDK drops events
    without a name)."""
    data = payload.model_dump(mode="json") if isinstance(payload, BaseModel) else payload
    return f"event: {name}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"
