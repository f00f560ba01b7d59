"""POST /v1/chat/completions, streamed (SSE) and not."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, Depends, Request
from fastapi.responses import StreamingResponse

from gateway import sse
from gateway.auth import require_api_key
from gateway.errors import APIError
from gateway.generation import (
    Generation,
    new_request_id,
    performance,
    sampling_params,
    served_model,
    system_fingerprint,
)
from gateway.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChoiceLogprobs,
    ChunkDelta,
    ContentLogprob,
    TopLogprob,
    Usage,
    error_responses,
)
from ipc.protocol import ChatMessage, Delta, Done, Submit, TokenLogprob

router = APIRouter(tags=["chat"], dependencies=[Depends(require_api_key)])


def content_logprobs(items: list[TokenLogprob]) -> list[ContentLogprob]:
    """Rank 0's per-token logprobs in the chat `logprobs.content` shape."""
    return [
        ContentLogprob(
            token=item.token,
            logprob=item.logprob,
            bytes=item.bytes if item.bytes is not None else list(item.token.encode()),
            top_logprobs=[
                TopLogprob(
                    token=top.token,
                    logprob=top.logprob,
                    bytes=top.bytes if top.bytes is not None else list(top.token.encode()),
                )
                for top in item.top_logprobs
            ],
        )
        for item in items
    ]


@router.post(
    "/v1/chat/completions",
    response_model=ChatCompletion,
    responses=error_responses(400, 401, 404, 413, 503, 504),
)
async def chat_completions(body: ChatCompletionRequest, request: Request):
    """Generate the assistant's next message for a conversation."""
    state = request.app.state
    model_id = served_model(state, body.model)
    max_tokens = body.max_completion_tokens or body.max_tokens
    params = sampling_params(state, body, max_tokens, body.logprobs, body.top_logprobs or 0)
    messages = [
        ChatMessage(role="system" if m.role == "developer" else m.role, content=m.text())
        for m in body.messages
    ]
    submit = Submit(id=new_request_id("chatcmpl"), messages=messages, params=params)
    generation = Generation(request, submit, "messages")
    await generation.start()
    base = {
        "id": submit.id,
        "created": int(time.time()),
        "model": model_id,
        "system_fingerprint": system_fingerprint(state),
    }
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        chunks = _stream(generation, base, include_usage, body.logprobs, state.metrics)
        return StreamingResponse(chunks, media_type="text/event-stream", headers=sse.HEADERS)
    text: list[str] = []
    logprobs: list[TokenLogprob] = []
    done: Done | None = None
    async for message in generation.events():
        if isinstance(message, Delta):
            text.append(message.text)
            logprobs += message.logprobs or []
        else:
            done = message
    assert done is not None
    choice = ChatChoice(
        message=AssistantMessage(content="".join(text)),
        logprobs=ChoiceLogprobs(content=content_logprobs(logprobs)) if body.logprobs else None,
        finish_reason=done.finish_reason,  # type: ignore[arg-type]
    )
    return ChatCompletion(
        **base,
        choices=[choice],
        usage=Usage(**done.usage.model_dump()),
        performance=performance(done.timings),
    )


async def _stream(
    generation: Generation, base: dict, include_usage: bool, logprobs: bool, metrics
) -> AsyncIterator[str]:
    drop = () if include_usage else ("usage",)
    drop_perf = (*drop, "performance")

    def chunk(choices: list[ChatChunkChoice], **extra) -> ChatCompletionChunk:
        return ChatCompletionChunk(**base, choices=choices, **extra)

    try:
        first = ChatChunkChoice(delta=ChunkDelta(role="assistant", content=""))
        yield sse.event(chunk([first]), drop=drop_perf)
        async for message in generation.events():
            if isinstance(message, Delta):
                lp = None
                if logprobs:
                    lp = ChoiceLogprobs(content=content_logprobs(message.logprobs or []))
                choice = ChatChunkChoice(delta=ChunkDelta(content=message.text), logprobs=lp)
                yield sse.event(chunk([choice]), drop=drop_perf)
                continue
            perf = performance(message.timings)
            last = ChatChunkChoice(delta=ChunkDelta(), finish_reason=message.finish_reason)
            yield sse.event(chunk([last], performance=perf), drop=drop)
            if include_usage:
                usage = Usage(**message.usage.model_dump())
                yield sse.event(chunk([], usage=usage, performance=perf))
            yield sse.DONE
    except APIError as exc:
        metrics.errors.labels(exc.type, exc.code or "").inc()
        yield sse.event(exc.body())
    finally:
        generation.close()
