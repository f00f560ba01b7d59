"""POST /v1/chat/completions: OpenAI chat requests to rank 0 and its events back, streamed
(SSE) or whole."""

from __future__ import annotations

from collections.abc import Iterator

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from gateway import sse
from gateway.openai.common import GENERATION_ERRORS, ChunkStream, begin, whole_response
from gateway.openai.convert import chat_submit, choice_finish_reason
from gateway.openai.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChoiceLogprobs,
    ChunkDelta,
)
from gateway.openai.tooling import ChunkToolCall, ResponseToolCall
from ipc.protocol import Delta, Done

router = APIRouter(tags=["chat"])  # API_KEY: gateway/auth.ApiKeyGate


@router.post("/v1/chat/completions", response_model=ChatCompletion, responses=GENERATION_ERRORS)
async def chat_completions(
    body: ChatCompletionRequest, request: Request
) -> ChatCompletion | StreamingResponse:
    """Generate the assistant's next message for a conversation."""
    generation, head = await begin(request, body, chat_submit, "chatcmpl", "messages")
    if body.stream:
        render = ChatStream(head, body.include_usage, body.logprobs)
        return generation.stream(render, render.opening())
    result = await generation.collect()
    calls = [ResponseToolCall.of(call) for call in result.tool_calls]
    message = AssistantMessage(
        content=result.text if result.text or not calls else None,
        reasoning_content=result.reasoning or None,
        tool_calls=calls or None,
    )
    choice = ChatChoice(
        message=message,
        logprobs=ChoiceLogprobs(content=result.logprobs) if body.logprobs else None,
        finish_reason=choice_finish_reason(result.done),
    )
    return whole_response(ChatCompletion, head, choice, result.done)


class ChatStream(ChunkStream):
    """Rank 0's events as chat.completion.chunk events: a role chunk first, then one chunk
    per delta (content, reasoning_content and tool-call pieces), a finish chunk, the usage
    chunk when asked for, then [DONE]."""

    chunk_model = ChatCompletionChunk

    def opening(self) -> Iterator[str]:
        first = ChatChunkChoice(delta=ChunkDelta(role="assistant", content=""))
        yield sse.event(self._chunk([first]), drop=(*self.drop, "performance"))

    def delta_choice(self, message: Delta) -> ChatChunkChoice:
        lp = ChoiceLogprobs(content=message.logprobs or []) if self.logprobs else None
        other = message.reasoning or message.tool_calls
        delta = ChunkDelta(
            content=message.text if message.text or not other else None,
            reasoning_content=message.reasoning or None,
            tool_calls=[ChunkToolCall.of(piece) for piece in message.tool_calls] or None,
        )
        return ChatChunkChoice(delta=delta, logprobs=lp)

    def finish_choice(self, message: Done) -> ChatChunkChoice:
        return ChatChunkChoice(delta=ChunkDelta(), finish_reason=choice_finish_reason(message))
