"""What the OpenAI routes share: from a request body to a running generation at rank 0,
the head every response and chunk of it repeats, the whole response once it is done, and
the SSE chunks of a streamed one."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol, TypeVar

from fastapi import Request
from pydantic import BaseModel

from gateway import sse
from gateway.core import Generation, Limits, new_request_id, served_model, system_fingerprint
from gateway.openai.protocol import Performance, ResponseHead, error_responses
from ipc.protocol import Delta, Done, Submit

ResponseT = TypeVar("ResponseT", bound=BaseModel)

# What a generation route may answer besides 200: a bad request, no API key, an unknown
# model, a body too large, the ranks unavailable or too slow.
GENERATION_ERRORS = error_responses(400, 401, 404, 413, 503, 504)


class NamesModel(Protocol):
    model: str | None


BodyT = TypeVar("BodyT", bound=NamesModel)


async def begin(
    request: Request,
    body: BodyT,
    to_submit: Callable[[BodyT, str, Limits], Submit],
    id_prefix: str,
    prompt_param: str,
) -> tuple[Generation, ResponseHead]:
    """Check the model, submit the request (`to_submit`: gateway/openai/convert.py) and wait
    until rank 0 accepted it (first, while the supervisor restarts the ranks, up to
    RESTART_WAIT_SECONDS for them)."""
    state = request.app.state
    await state.rank_client.wait_for_restart(state.settings.restart_wait_seconds)
    model_id = served_model(state.rank_client, body.model)
    submit = to_submit(body, new_request_id(id_prefix), Limits.of(state))
    generation = Generation(request, submit, prompt_param)
    await generation.start()
    head = ResponseHead(
        id=submit.id,
        created=int(time.time()),
        model=model_id,
        system_fingerprint=system_fingerprint(state.rank_client),
    )
    return generation, head


def whole_response(
    model: type[ResponseT], head: ResponseHead, choice: BaseModel, done: Done
) -> ResponseT:
    """A finished generation as one response of `model`: its one choice, usage and
    performance."""
    return model(
        **head.model_dump(),
        choices=[choice],
        usage=done.usage,
        performance=Performance.of(done.timings),
    )


class ChunkStream:
    """Rank 0's events as SSE chunks of `chunk_model`: one per delta, a finish chunk, the
    usage chunk when asked for, then [DONE]. A subclass says what choice a delta and the
    finish make."""

    chunk_model: type[BaseModel]

    def __init__(self, head: ResponseHead, include_usage: bool, logprobs: bool) -> None:
        self.head = head.model_dump()
        self.include_usage = include_usage
        self.logprobs = logprobs
        self.drop: tuple[str, ...] = () if include_usage else ("usage",)

    def _chunk(self, choices: Sequence[BaseModel], **extra: object) -> BaseModel:
        return self.chunk_model(**self.head, choices=choices, **extra)

    def delta_choice(self, message: Delta) -> BaseModel:
        """The choice of the chunk that carries one delta."""
        raise NotImplementedError

    def finish_choice(self, message: Done) -> BaseModel:
        """The choice of the chunk that carries the finish reason."""
        raise NotImplementedError

    def __call__(self, message: Delta | Done) -> Iterator[str]:
        if isinstance(message, Delta):
            choice = self.delta_choice(message)
            yield sse.event(self._chunk([choice]), drop=(*self.drop, "performance"))
            return
        perf = Performance.of(message.timings)
        last = self.finish_choice(message)
        yield sse.event(self._chunk([last], performance=perf), drop=self.drop)
        if self.include_usage:
            yield sse.event(self._chunk([], usage=message.usage, performance=perf))
        yield sse.DONE
