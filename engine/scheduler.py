"""Rank 0's scheduler: request queue, admission, step plans, sampling results -> messages.

Only rank 0 runs this. It turns socket events into step plans and the logits of each
step into Delta/Done messages, enforcing EOS, max_tokens, stop strings, grammar
constraints and the prompt-length limit (a refused prompt is answered here and never
broadcast). Constraints change only which token rank 0 samples, never what any rank
computes.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np

from engine.answer import AnswerStream, Piece
from engine.batch_engine import BatchEngine, StepResult
from engine.constraints import GrammarTokens, TokenConstraint, apply_mask
from engine.detokenize import token_bytes
from engine.prefix_cache import PlanOps, PrefixCache
from engine.request_setup import Refusal, RequestSetup, SetupResult
from engine.sampler import RequestSampler, Sample
from engine.sampling_defaults import SamplingDefaults
from engine.step_plan import StepPlan
from ipc.protocol import (
    Delta,
    Done,
    Error,
    PromptTokensDetails,
    SamplingParams,
    Started,
    Submit,
    Timings,
    TokenLogprob,
    TopLogprob,
    Usage,
)

log = logging.getLogger("ring.scheduler")
KEEP_WARM_CONN = -1  # rank 0's own keep-warm requests: no connection, nothing is sent

Outbox = list[tuple[Any, Any]]  # (connection key, message)


@dataclass
class Request:
    """One request's state on rank 0."""

    conn: Any
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
    finished: str | None = None

    @property
    def max_tokens(self) -> int:
        return self.submit.params.max_tokens


class Scheduler:
    """Queue and batch decisions; every method runs on rank 0's main thread."""

    def __init__(
        self,
        tokenizer: Any,
        max_batch_size: int,
        max_sequence_length: int,
        prefix: PrefixCache | None = None,
        *,
        grammar: GrammarTokens | None = None,
        defaults: SamplingDefaults | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.setup = RequestSetup(tokenizer, grammar)
        self.defaults = defaults or SamplingDefaults()
        self.prefix = prefix or PrefixCache(0)
        self.max_batch_size = max_batch_size
        self.max_sequence_length = max_sequence_length
        self.eos_ids = set(getattr(tokenizer, "eos_token_ids", None) or [])
        if tokenizer.eos_token_id is not None:
            self.eos_ids.add(tokenizer.eos_token_id)
        self.queue: deque[Request] = deque()
        self.active: dict[int, Request] = {}
        self.by_key: dict[tuple[Any, str], Request] = {}
        self.to_remove: list[int] = []
        self.next_token: dict[int, int] = {}
        self._seq_ids = itertools.count(1)
        self.outbox: Outbox = []

    # ---- events from the socket ------------------------------------------------------

    def submit(self, conn: Any, submit: Submit) -> None:
        """Validate, render, tokenize and queue a request, answering Started or Error."""
        key = (conn, submit.id)
        if key in self.by_key:
            message = f"request id {submit.id!r} is already running on this connection"
            self._refuse(conn, submit.id, "duplicate_id", message)
            return
        try:
            setup = self.setup.prepare(submit)
            self._check_length(submit, setup.prompt)
        except Refusal as refusal:
            self._refuse(conn, submit.id, refusal.code, str(refusal), refusal.param)
            return
        if submit.count_only:
            self._count(conn, submit, len(setup.prompt))
            return
        self._queue(conn, submit, setup)

    def _check_length(self, submit: Submit, prompt: list[int]) -> None:
        if submit.count_only:
            return
        limit = self.max_sequence_length - submit.params.max_tokens
        if len(prompt) > limit:
            raise Refusal(
                "prompt_too_long",
                f"the prompt has {len(prompt)} tokens; with max_tokens="
                f"{submit.params.max_tokens} it may have at most {max(limit, 0)} "
                f"(MAX_SEQUENCE_LENGTH={self.max_sequence_length}); shorten the prompt "
                "or lower max_tokens",
            )

    def _queue(self, conn: Any, submit: Submit, setup: SetupResult) -> None:
        params = self.defaults.resolve(submit.params)
        request = Request(
            conn=conn,
            id=submit.id,
            seq_id=next(self._seq_ids),
            prompt=setup.prompt,
            submit=submit.model_copy(update={"params": params}),
            sampler=RequestSampler(params, setup.prompt),
            answer=AnswerStream(self.tokenizer, params.stop, setup.shape),
            constraint=setup.constraint,
            arrived=time.monotonic(),
        )
        self.by_key[(conn, submit.id)] = request
        self.queue.append(request)
        self.outbox.append((conn, Started(id=submit.id, prompt_tokens=len(setup.prompt))))

    def _count(self, conn: Any, submit: Submit, prompt_tokens: int) -> None:
        """A count_only request: its prompt's size, and nothing generated."""
        self.outbox.append((conn, Started(id=submit.id, prompt_tokens=prompt_tokens)))
        usage = Usage(prompt_tokens=prompt_tokens, completion_tokens=0, total_tokens=prompt_tokens)
        timings = Timings(
            time_to_first_token_s=0.0,
            prompt_tokens_per_second=0.0,
            generation_tokens_per_second=0.0,
            total_time_s=0.0,
        )
        done = Done(id=submit.id, finish_reason="stop", usage=usage, timings=timings)
        self.outbox.append((conn, done))

    def _refuse(
        self, conn: Any, request_id: str, code: str, message: str, param: str | None = None
    ) -> None:
        log.info("refused request %s (%s): %s", request_id, code, message)
        error = Error(id=request_id, code=code, message=message, param=param)
        self.outbox.append((conn, error))

    def keep_warm(self) -> None:
        """Queue a one-token request of rank 0's own. After minutes of idle the machine may
        let the model's memory go cold (measured: the next first token took 1.75x as long
        after 10 minutes idle, 1.02x with this every 60 s); every rank steps it."""
        params = SamplingParams(max_tokens=1, temperature=0.0)
        self.submit(KEEP_WARM_CONN, Submit(id="keep-warm", prompt="Hello", params=params))

    def cancel(self, conn: Any, request_id: str, notify: bool = True) -> None:
        """Drop a request wherever it is; it leaves the batch at the next step."""
        request = self.by_key.get((conn, request_id))
        if request is None or request.finished:
            return
        if request in self.queue:
            self.queue.remove(request)
        self._finish(request, "cancelled", notify=notify)

    def connection_closed(self, conn: Any) -> None:
        """Cancel every request of a connection that went away."""
        for key in [k for k in self.by_key if k[0] == conn]:
            self.cancel(conn, key[1], notify=False)

    def cancel_all(self, reason: str = "cancelled") -> None:
        for request in list(self.by_key.values()):
            if request in self.queue:
                self.queue.remove(request)
            self._finish(request, reason)

    # ---- step plans --------------------------------------------------------------

    def has_work(self, engine: BatchEngine) -> bool:
        return bool(self.queue or self.to_remove or engine.size)

    def build_plan(self, engine: BatchEngine) -> StepPlan:
        """The next plan: prefix-cache stores and evictions, removes, next tokens of the
        decode batch, admitted inserts (a request may wait for a prefix being stored)."""
        removes, self.to_remove = self.to_remove, []
        removed = set(removes)
        tokens = [self.next_token.pop(s) for s in engine.decode_ids if s not in removed]
        for seq_id in removed:
            self.next_token.pop(seq_id, None)
        ops = PlanOps()
        self.prefix.plan_stores(ops)
        room = self.max_batch_size - (engine.size - len(removed))
        inserts = []
        for request in list(self.queue):
            if room <= 0:
                break
            insert = self.prefix.admit(request.seq_id, request.prompt, ops)
            if insert is None:
                continue  # a prefilling request is about to store most of its prompt
            self.queue.remove(request)
            self.active[request.seq_id] = request
            request.prefix_len = insert.prefix_len
            if insert.prefix_len:
                log.debug(
                    "prefix hit for request %s: %d of %d prompt tokens from entry %d",
                    request.id,
                    insert.prefix_len,
                    len(request.prompt),
                    insert.prefix_entry,
                )
            inserts.append(insert)
            room -= 1
        return StepPlan(
            step=engine.step_index,
            fingerprint=engine.fingerprint(),
            removes=removes,
            tokens=tokens,
            inserts=inserts,
            stores=ops.stores,
            evicts=ops.evicts,
        )

    def idle_plan(self, engine: BatchEngine, stop: bool = False) -> StepPlan:
        """A plan that runs no compute: all ranks go to sleep (or stop)."""
        return StepPlan(
            step=engine.step_index,
            fingerprint=engine.fingerprint(),
            sleep=not stop,
            stop=stop,
        )

    # ---- results -----------------------------------------------------------------

    def on_result(self, result: StepResult) -> None:
        """Sample every row, stream deltas, finish requests that are done."""
        if result.logits is None:
            return
        rows = np.array(result.logits.astype(mx.float32))
        now = time.monotonic()
        for row, seq_id in zip(rows, result.seq_ids, strict=True):
            request = self.active.get(seq_id)
            if request is None or request.finished:
                self.next_token[seq_id] = 0  # removed next step; any token will do
                continue
            try:
                if request.constraint is not None:
                    apply_mask(row, request.constraint.mask())
                self._accept(request, request.sampler.sample(row), now)
            except Exception as exc:  # one request's trouble must never stop the loop
                log.error("request %s failed while sampling or decoding: %r", request.id, exc)
                message = f"generation failed for this request: {exc}"
                self.outbox.append(
                    (request.conn, Error(id=request.id, code="internal", message=message))
                )
                self.next_token[seq_id] = 0
                if not request.finished:
                    self._finish(request, "stop", notify=False)

    def _accept(self, request: Request, sample: Sample, now: float) -> None:
        if request.first_token_at is None:
            request.first_token_at = now
            self.prefix.prefilled(request.seq_id)
        token = sample.token
        request.generated.append(token)
        self.next_token[request.seq_id] = token
        request.unsent_ids.append(token)
        if sample.logprob is not None:
            request.unsent_logprobs.append(self._logprob(token, sample))
        if request.constraint is not None:
            request.constraint.consume(token)
        if token in self.eos_ids:
            self._emit(request, request.answer.finish(complete=True), final=True)
            self._finish(request, "stop", completed=True)
            return
        piece, hit = request.answer.push(token)
        grammar_done = request.constraint is not None and request.constraint.finished
        if hit or grammar_done:
            self._emit(request, piece.add(request.answer.finish(complete=True)), final=True)
            self._finish(request, "stop", completed=True)
        elif len(request.generated) >= request.max_tokens:
            self._emit(request, piece.add(request.answer.finish(complete=False)), final=True)
            self._finish(request, "length", completed=True)
        else:
            self._emit(request, piece, final=False)

    def _logprob(self, token: int, sample: Sample) -> TokenLogprob:
        def piece(t: int) -> tuple[str, list[int]]:
            return self.tokenizer.decode([t]), list(token_bytes(self.tokenizer, t))

        text, raw = piece(token)
        top = []
        for t, lp in sample.top:
            top_text, top_raw = piece(t)
            top.append(TopLogprob(token=top_text, logprob=lp, bytes=top_raw))
        return TokenLogprob(token=text, logprob=sample.logprob, bytes=raw, top_logprobs=top)

    def _emit(self, request: Request, piece: Piece, final: bool) -> None:
        if not (piece or request.unsent_logprobs or (final and request.unsent_ids)):
            return
        delta = Delta(
            id=request.id,
            text=piece.text,
            reasoning=piece.reasoning,
            tool_calls=piece.tool_calls,
            token_ids=request.unsent_ids,
            logprobs=request.unsent_logprobs or None,
        )
        request.unsent_ids, request.unsent_logprobs = [], []
        self.outbox.append((request.conn, delta))

    def _finish(
        self, request: Request, reason: str, notify: bool = True, completed: bool = False
    ) -> None:
        """End a request; a `completed` one's prompt and answer go to the prefix cache."""
        if reason == "stop" and request.answer.calls:
            reason = "tool_calls"
        request.finished = reason
        self.by_key.pop((request.conn, request.id), None)
        if request.seq_id in self.active:
            del self.active[request.seq_id]
            self.to_remove.append(request.seq_id)
            cached = request.prompt + request.generated[:-1]  # the last one was never fed
            self.prefix.finished(request.seq_id, cached, completed)
        done = self._done(request, reason)
        if notify:
            self.outbox.append((request.conn, done))
        log.log(
            logging.DEBUG if request.conn == KEEP_WARM_CONN else logging.INFO,
            "request %s %s: %d prompt + %d completion tokens, first token %.3f s, %.1f tok/s",
            request.id,
            reason if notify else "cancelled (client went away)",
            done.usage.prompt_tokens,
            done.usage.completion_tokens,
            done.timings.time_to_first_token_s,
            done.timings.generation_tokens_per_second,
        )

    def _done(self, request: Request, reason: str) -> Done:
        end = time.monotonic()
        first = request.first_token_at or end
        ttft = first - request.arrived
        completion = len(request.generated)
        decode_time = end - first
        prompt_tokens = len(request.prompt)
        return Done(
            id=request.id,
            finish_reason=reason,
            stop_sequence=request.answer.stop_sequence,
            usage=Usage(
                prompt_tokens=prompt_tokens,
                completion_tokens=completion,
                total_tokens=prompt_tokens + completion,
                prompt_tokens_details=PromptTokensDetails(cached_tokens=request.prefix_len),
            ),
            timings=Timings(
                time_to_first_token_s=ttft,
                prompt_tokens_per_second=prompt_tokens / ttft if ttft > 0 else 0.0,
                generation_tokens_per_second=(
                    (completion - 1) / decode_time if completion > 1 and decode_time > 0 else 0.0
                ),
                total_time_s=end - request.arrived,
            ),
        )
