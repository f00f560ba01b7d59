"""OpenAI requests (gateway/openai/protocol.py) as the message rank 0 takes (ipc.protocol
`Submit`): messages, sampling parameters and the answer's cap (gateway.core.Limits); the
chat's agent fields through gateway/openai/tooling.py. And back: rank 0's finish reason as
a choice shows it. The routes (chat.py, completions.py, through common.begin) call these."""

from __future__ import annotations

from gateway.core import Limits
from gateway.openai.protocol import (
    ChatCompletionRequest,
    ChoiceFinishReason,
    CompletionRequest,
    RequestMessage,
)
from ipc.protocol import ChatMessage, Done, SamplingParams, Submit


def chat_submit(body: ChatCompletionRequest, request_id: str, limits: Limits) -> Submit:
    """POST /v1/chat/completions as rank 0's Submit."""
    max_tokens = limits.max_tokens(body.max_completion_tokens or body.max_tokens)
    top = (body.top_logprobs or 0) if body.logprobs else None
    params = sampling_params(body, max_tokens, top)
    return Submit(
        id=request_id,
        messages=[chat_message(m) for m in body.messages],
        params=params,
        **body.agent_fields(),
    )


def completion_submit(body: CompletionRequest, request_id: str, limits: Limits) -> Submit:
    """POST /v1/completions as rank 0's Submit."""
    params = sampling_params(body, limits.max_tokens(body.max_tokens), body.logprobs)
    return Submit(id=request_id, prompt=body.prompt_text(), params=params)


def chat_message(message: RequestMessage) -> ChatMessage:
    """One turn as rank 0 takes it (a developer turn is a system turn)."""
    role = "system" if message.role == "developer" else message.role
    return ChatMessage(
        role=role,
        content=message.text(),
        reasoning=message.reasoning_content or message.reasoning,
        tool_calls=[call.to_call() for call in message.tool_calls or []],
        tool_call_id=message.tool_call_id,
        name=message.name if message.role == "tool" else None,
    )


def sampling_params(
    body: ChatCompletionRequest | CompletionRequest, max_tokens: int, top_logprobs: int | None
) -> SamplingParams:
    """Rank 0's parameters; `top_logprobs` None means no logprobs. Sampling values left
    unset stay None: rank 0 fills in the served model's defaults."""
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        min_p=body.min_p,
        # The ranks seed numpy, which takes non-negative ints: map int64 one-to-one.
        seed=None if body.seed is None else body.seed % 2**64,
        stop=body.stop_list(),
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        repetition_penalty=body.repetition_penalty or 1.0,
        logprobs=top_logprobs is not None,
        top_logprobs=top_logprobs or 0,
    )


def choice_finish_reason(done: Done) -> ChoiceFinishReason:
    """Rank 0's reason as a choice shows it (core.Generation turns "cancelled" into an error)."""
    if done.finish_reason == "cancelled":
        raise ValueError("a cancelled request has no choice")
    return done.finish_reason
