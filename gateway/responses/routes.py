"""POST /v1/responses, GET and DELETE /v1/responses/{id}: OpenAI's Responses API over the
same generation core as chat completions and Messages (Codex CLI, the openai SDK's
`client.responses`, the OpenAI Agents SDK)."""

from __future__ import annotations

from collections.abc import Iterator

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from gateway import sse
from gateway.core import Generation, Limits, served_model
from gateway.errors import APIError
from gateway.openai.protocol import error_responses
from gateway.responses.convert import ConversionError, answer_turn, to_submit, turns
from gateway.responses.protocol import DeletedResponse, Response, ResponsesRequest
from gateway.responses.store import ResponseStore
from gateway.responses.stream import ResponseBuilder, item_id
from ipc.protocol import ChatMessage, Delta, Done

router = APIRouter(tags=["responses"])


def _store(request: Request) -> ResponseStore:
    store: ResponseStore = request.app.state.responses
    return store


def _not_stored(response_id: str, param: str | None = None) -> APIError:
    return APIError(
        404,
        f"No response with id '{response_id}' is stored here: responses are kept in api.py's "
        "memory (RESPONSE_STORE_BYTES) while it runs, and only those created with store=true.",
        param=param,
        code="response_not_found",
    )


@router.post(
    "/v1/responses",
    response_model=Response,
    responses=error_responses(400, 401, 404, 413, 503, 504),
)
async def create_response(body: ResponsesRequest, request: Request) -> Response | StreamingResponse:
    """Generate the model's next output for a conversation of input items."""
    state = request.app.state
    store = _store(request)
    history: list[ChatMessage] = []
    if body.previous_response_id is not None:
        previous = store.get(body.previous_response_id)
        if previous is None:
            raise _not_stored(body.previous_response_id, "previous_response_id")
        history = previous.conversation
    await state.rank_client.wait_for_restart(state.settings.restart_wait_seconds)
    model_id = served_model(state.rank_client, body.model)
    response_id = item_id("resp")
    try:
        dialogue = turns(body, history)
        submit = to_submit(body, dialogue, response_id, Limits.of(state))
    except ConversionError as exc:
        raise APIError(400, str(exc), param=exc.param) from None
    generation = Generation(request, submit, "input")
    await generation.start()
    shell = body.response_shell(response_id, model_id)
    builder = ResponseBuilder(shell)

    def keep(message: Delta | Done) -> None:
        if isinstance(message, Done) and body.store:
            store.put(builder.response, [*dialogue, answer_turn(builder.response.output)])

    if not body.stream:
        async for message in generation.events():
            builder.feed(message)
            keep(message)
        return builder.response

    def render(message: Delta | Done) -> Iterator[str]:
        events = builder.feed(message)
        keep(message)
        for event in events:
            yield sse.named_event(event["type"], event)

    opening = (sse.named_event(event["type"], event) for event in builder.opening())

    def error(exc: APIError) -> str:
        return sse.named_event("error", builder.error(exc))

    return generation.stream(render, opening, error)


@router.get("/v1/responses/{response_id}", response_model=Response)
async def get_response(response_id: str, request: Request) -> Response:
    """A stored response."""
    stored = _store(request).get(response_id)
    if stored is None:
        raise _not_stored(response_id)
    return stored.response


@router.delete("/v1/responses/{response_id}", response_model=DeletedResponse)
async def delete_response(response_id: str, request: Request) -> DeletedResponse:
    """Forget a stored response."""
    if not _store(request).delete(response_id):
        raise _not_stored(response_id)
    return DeletedResponse(id=response_id)
