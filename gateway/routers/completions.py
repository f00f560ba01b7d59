"""POST /v1/completions (legacy text completions), streamed (SSE) and not."""

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
    CompletionLogprobs,
    CompletionRequest,
    TextChoice,
    TextCompletion,
    Usage,
    error_responses,
)
from ipc.protocol import Delta, Done, Submit, TokenLogprob

router = APIRouter(tags=["completions"], dependencies=[Depends(require_api_key)])


def text_logprobs(items: list[TokenLogprob], offset: int) -> CompletionLogprobs:
    """Rank 0's per-token logprobs in the completions shape; offsets start at `offset`."""
    result = CompletionLogprobs()
    for item in items:
        result.tokens.append(item.token)
        result.token_logprobs.append(item.logprob)
        result.top_logprobs.append({top.token: top.logprob for top in item.top_logprobs})
        result.text_offset.append(offset)
        offset += len(item.token)
    return result


@router.post(
    "/v1/completions",
    response_model=TextCompletion,
    responses=error_responses(400, 401, 404, 413, 503, 504),
)
async def completions(body: CompletionRequest, request: Request):
    """Continue a text prompt."""
    state = request.app.state
    model_id = served_model(state, body.model)
    want_logprobs = body.logprobs is not None
    params = sampling_params(state, body, body.max_tokens, want_logprobs, body.logprobs or 0)
    submit = Submit(id=new_request_id("cmpl"), prompt=body.prompt_text(), params=params)
    generation = Generation(request, submit, "prompt")
    await generation.start()
    base = {
        "id": submit.id,
        "created": int(time.time()),
        "model": model_id,
        "system_fingerprint": system_fingerprint(state),
    }
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        chunks = _stream(generation, base, include_usage, want_logprobs, state.metrics)
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
    choice = TextChoice(
        text="".join(text),
        logprobs=text_logprobs(logprobs, 0) if want_logprobs else None,
        finish_reason=done.finish_reason,  # type: ignore[arg-type]
    )
    return TextCompletion(
        **base,
        choices=[choice],
        usage=Usage(**done.usage.model_dump()),
        performance=performance(done.timings),
    )


async def _stream(
    generation: Generation, base: dict, include_usage: bool, logprobs: bool, metrics
) -> AsyncIterator[str]:
    drop = () if include_usage else ("usage",)
    offset = 0
    try:
        async for message in generation.events():
            if isinstance(message, Delta):
                lp = text_logprobs(message.logprobs or [], offset) if logprobs else None
                offset += len(message.text)
                chunk = TextCompletion(**base, choices=[TextChoice(text=message.text, logprobs=lp)])
                yield sse.event(chunk, drop=(*drop, "performance"))
                continue
            perf = performance(message.timings)
            last = TextChoice(text="", finish_reason=message.finish_reason)
            yield sse.event(TextCompletion(**base, choices=[last], performance=perf), drop=drop)
            if include_usage:
                usage = Usage(**message.usage.model_dump())
                yield sse.event(TextCompletion(**base, choices=[], usage=usage, performance=perf))
            yield sse.DONE
    except APIError as exc:
        metrics.errors.labels(exc.type, exc.code or "").inc()
        yield sse.event(exc.body())
    finally:
        generation.close()
