"""Server-sent events framing shared by the streaming routes."""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel

DONE = "data: [DONE]\n\n"
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def event(payload: BaseModel | dict[str, Any], *, drop: tuple[str, ...] = ()) -> str:
    """One `data:` event; keys in `drop` are left out of the top-level object."""
    data = payload.model_dump(mode="json") if isinstance(payload, BaseModel) else dict(payload)
    for key in drop:
        data.pop(key, None)
    for choice in data.get("choices") or []:
        if isinstance(choice.get("delta"), dict):
            choice["delta"] = {k: v for k, v in choice["delta"].items() if v is not None}
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"
