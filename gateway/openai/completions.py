"""POST /v1/completions (legacy text completions): a prompt to rank 0 and its events back,
streamed (SSE) or whole."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from gateway.openai.common import GENERATION_ERRORS, ChunkStream, begin, whole_response
from gateway.openai.convert import choice_finish_reason, completion_submit
from gateway.openai.protocol import (
    CompletionLogprobs,
    CompletionRequest,
    ResponseHead,
    TextChoice,
    TextCompletion,
)
from ipc.protocol import Delta, Done, TokenLogprob

router = APIRouter(tags=["completions"])  # API_KEY: gateway/auth.ApiKeyGate


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


@router.post("/v1/completions", response_model=TextCompletion, responses=GENERATION_ERRORS)
async def completions(
    body: CompletionRequest, request: Request
) -> TextCompletion | StreamingResponse:
    """Continue a text prompt."""
    want_logprobs = body.logprobs is not None
    generation, head = await begin(request, body, completion_submit, "cmpl", "prompt")
    if body.stream:
        return generation.stream(TextStream(head, body.include_usage, want_logprobs))
    result = await generation.collect()
    choice = TextChoice(
        text=result.text,
        logprobs=text_logprobs(result.logprobs, 0) if want_logprobs else None,
        finish_reason=choice_finish_reason(result.done),
    )
    return whole_response(TextCompletion, head, choice, result.done)


class TextStream(ChunkStream):
    """Rank 0's events as text_completion chunks: one per delta, a finish chunk, the usage
    chunk when asked for, then [DONE]."""

    chunk_model = TextCompletion

    def __init__(self, head: ResponseHead, include_usage: bool, logprobs: bool) -> None:
        super().__init__(head, include_usage, logprobs)
        self.offset = 0  # characters streamed so far, for the logprobs' text offsets

    def delta_choice(self, message: Delta) -> TextChoice:
        lp = text_logprobs(message.logprobs or [], self.offset) if self.logprobs else None
        self.offset += len(message.text)
        return TextChoice(text=message.text, logprobs=lp)

    def finish_choice(self, message: Done) -> TextChoice:
        return TextChoice(text="", finish_reason=choice_finish_reason(message))
