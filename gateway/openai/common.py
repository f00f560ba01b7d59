"""What the OpenAI routes share: from a request body to a running generation at rank 0,
and the head every response and chunk of it repeats."""

from __future__ import annotations

import time
from typing import Protocol

from fastapi import Request

from gateway.core import Generation, Limits, new_request_id, served_model, system_fingerprint
from gateway.openai.protocol import ResponseHead
from ipc.protocol import Submit


class Submittable(Protocol):
    model: str | None

    def to_submit(self, request_id: str, limits: Limits) -> Submit: ...


async def begin(
    request: Request, body: Submittable, id_prefix: str, prompt_param: str
) -> tuple[Generation, ResponseHead]:
    """Check the model, submit the request and wait until rank 0 accepted it (first, while
    the supervisor restarts the ranks, up to RESTART_WAIT_SECONDS for them)."""
    state = request.app.state
    await state.rank_client.wait_for_restart(state.settings.restart_wait_seconds)
    model_id = served_model(state.rank_client, body.model)
    submit = body.to_submit(new_request_id(id_prefix), Limits.of(state))
    generation = Generation(request, submit, prompt_param)
    await generation.start()
    head = ResponseHead(
        id=submit.id,
        created=int(time.time()),
        model=model_id,
        system_fingerprint=system_fingerprint(state.rank_client),
    )
    return generation, head
