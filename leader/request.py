"""One request on rank 0: what it was asked, what it drew, and the messages it sends.

Each sampled token is taken twice. `take` runs as soon as the step's tokens are back: it
records the token (penalties and grammar move on) and decides the ends that need no text:
EOS, a complete grammar, max_tokens. `stream` runs later, while the next step computes:
it detokenizes, splits answer, reasoning and tool calls, finds stop strings and builds the
Delta (and the Done at the end). A stop string found there ends the request one step
later than its token; the token drawn for it meanwhile is dropped.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Literal

from mlx_lm.tokenizer_utils import TokenizerWrapper

from ipc.events import ConnectionId
from ipc.protocol import (
    Delta,
    Done,
    FinishReason,
    PromptTokensDetails,
    Submit,
    Timings,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from leader.answer import AnswerStream, Piece
from leader.constraints import TokenConstraint
from leader.detokenize import token_bytes
from leader.sampler import RequestSampler, Sample
from leader.spec_rule import Figures

# Why a request ends without looking at its text: EOS, its grammar complete, or max_tokens.
Ending = Literal["eos", "grammar", "length"]


@dataclass
class Request:
    """One request's state on rank 0."""

    conn: ConnectionId
    id: str
    seq_id: int
    prompt: list[int]
    submit: Submit
    sampler: RequestSampler
    answer: AnswerStream
    constraint: TokenConstraint | None
    arrived: float
    generated: list[int] = field(default_factory=list)
    first_token_at: float | None = None
    prefix_len: int = 0  # prompt tokens taken from the prefix cache
    unsent_ids: list[int] = field(default_factory=list)
    unsent_logprobs: list[TokenLogprob] = field(default_factory=list)
    finished: str | None = None  # it left the batch (why)
    ended: bool = False  # its Done (or Error) went out: nothing more is streamed
    speculation: Figures = field(default_factory=Figures)  # proposed, accepted, steps
    streamed: int = 0  # tokens of `generated` streamed so far
    unsent_accepted: int = 0  # of unsent_ids, proposals a speculative step accepted

    @property
    def max_tokens(self) -> int:
        return self.submit.params.max_tokens

    def take(self, token: int, eos_ids: set[int]) -> Ending | None:
        """Record a drawn token; the end it makes, when its text is not needed to tell."""
        self.generated.append(token)
        self.sampler.record(token)
        if token in eos_ids:
            return "eos"
        if self.constraint is not None and self.constraint.finished:
            return "grammar"
        if len(self.generated) >= self.max_tokens:
            return "length"
        return None

    def stream(
        self, sample: Sample, ending: Ending | None, tokenizer: TokenizerWrapper
    ) -> tuple[list[Delta | Done], bool]:
        """The messages for a taken token, and whether a stop string (or a finished tool
        block) ends the request here though `take` did not."""
        self.unsent_ids.append(sample.token)
        self.unsent_accepted += sample.accepted
        self.streamed += 1
        if sample.logprob is not None:
            self.unsent_logprobs.append(_logprob(tokenizer, sample))
        if ending == "eos":
            return self._final(self.answer.finish(complete=True), "stop"), False
        piece, hit = self.answer.push(sample.token)
        if hit:  # tokens taken after it (a speculative step's run) were never answered
            del self.generated[self.streamed :]
        if hit or ending == "grammar":
            return self._final(piece.add(self.answer.finish(complete=True)), "stop"), hit
        if ending == "length":
            return self._final(piece.add(self.answer.finish(complete=False)), "length"), False
        delta = self._delta(piece, final=False)
        return ([delta] if delta else []), False

    def _final(self, piece: Piece, reason: FinishReason) -> list[Delta | Done]:
        delta = self._delta(piece, final=True)
        return [*([delta] if delta else []), self.done(reason)]

    def _delta(self, piece: Piece, final: bool) -> Delta | None:
        if not (piece or self.unsent_logprobs or (final and self.unsent_ids)):
            return None
        delta = Delta(
            id=self.id,
            text=piece.text,
            reasoning=piece.reasoning,
            tool_calls=piece.tool_calls,
            token_ids=self.unsent_ids,
            accepted=self.unsent_accepted,
            logprobs=self.unsent_logprobs or None,
        )
        self.unsent_ids, self.unsent_logprobs, self.unsent_accepted = [], [], 0
        return delta

    def done(self, reason: FinishReason) -> Done:
        """The request's Done (a stop after tool calls reports tool_calls)."""
        self.ended = True
        if reason == "stop" and self.answer.calls:
            reason = "tool_calls"
        end = time.monotonic()
        first = self.first_token_at or end
        ttft = first - self.arrived
        completion = len(self.generated)
        decode_time = end - first
        prompt_tokens = len(self.prompt)
        return Done(
            id=self.id,
            finish_reason=reason,
            stop_sequence=self.answer.stop_sequence,
            usage=Usage(
                prompt_tokens=prompt_tokens,
                completion_tokens=completion,
                total_tokens=prompt_tokens + completion,
                prompt_tokens_details=PromptTokensDetails(cached_tokens=self.prefix_len),
            ),
            timings=Timings(
                time_to_first_token_s=ttft,
                prompt_tokens_per_second=prompt_tokens / ttft if ttft > 0 else 0.0,
                generation_tokens_per_second=(
                    (completion - 1) / decode_time if completion > 1 and decode_time > 0 else 0.0
                ),
                total_time_s=end - self.arrived,
                proposed_tokens=self.speculation.proposed,
                accepted_tokens=self.speculation.accepted,
                decode_steps=self.speculation.steps,
            ),
        )


def _logprob(tokenizer: TokenizerWrapper, sample: Sample) -> TokenLogprob:
    def piece(token: int) -> tuple[str, list[int]]:
        return tokenizer.decode([token]), list(token_bytes(tokenizer, token))

    text, raw = piece(sample.token)
    top = []
    for token, logprob in sample.top:
        top_text, top_raw = piece(token)
        top.append(TopLogprob(token=top_text, logprob=logprob, bytes=top_raw))
    assert sample.logprob is not None
    return TokenLogprob(token=text, logprob=sample.logprob, bytes=raw, top_logprobs=top)
