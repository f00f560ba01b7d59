"""Every request rank 0 holds, from its arrival to its end: how one enters (validated,
rendered, tokenized, then queued or refused with the reason; a refused prompt is answered
here and never broadcast), how it leaves (completed, cancelled, failed, its connection
gone), and the messages for the socket that this produces (`outbox`).

leader/scheduler.py admits queued requests to the batch and takes their tokens; every
method runs on rank 0's main thread.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from dataclasses import replace

from mlx_lm.tokenizer_utils import TokenizerWrapper

from ipc.events import KEEP_WARM, ConnectionId
from ipc.protocol import (
    Delta,
    Done,
    Error,
    FinishReason,
    SamplingParams,
    Started,
    Submit,
    Timings,
    Usage,
)
from leader.answer import AnswerStream
from leader.constraints import GrammarTokens
from leader.prefix_cache import PrefixCache
from leader.request import Request
from leader.request_setup import Refusal, RequestSetup, SetupResult
from leader.sampler import RequestSampler
from leader.sampling_defaults import SamplingDefaults

log = logging.getLogger("ring.scheduler")
Outbox = list[tuple[ConnectionId, Started | Delta | Done | Error]]


class Requests:
    """The queue, the requests in the batch (by sequence id), every live request by
    (connection, id), the sequences to remove at the next plan, and the outbox."""

    def __init__(
        self,
        tokenizer: TokenizerWrapper,
        max_sequence_length: int,
        prefix: PrefixCache | None = None,
        grammar: GrammarTokens | None = None,
        defaults: SamplingDefaults | None = None,
        vocab_size: int | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.setup = RequestSetup(tokenizer, grammar, vocab_size)
        self.defaults = defaults or SamplingDefaults()
        self.prefix = prefix or PrefixCache(0)  # budget 0: off
        self.max_sequence_length = max_sequence_length
        self.queue: deque[Request] = deque()
        self.active: dict[int, Request] = {}
        self.by_key: dict[tuple[ConnectionId, str], Request] = {}
        self.to_remove: list[int] = []
        self._seq_ids = itertools.count(1)
        self.outbox: Outbox = []

    # ---- arrivals ----------------------------------------------------------------

    def submit(self, conn: ConnectionId, submit: Submit) -> None:
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
        """Only a prompt that leaves no room for one answer token is refused; a cap larger
        than the room left is not an error (`budget`)."""
        if submit.count_only or len(prompt) < self.max_sequence_length:
            return
        raise Refusal(
            "prompt_too_long",
            f"the prompt has {len(prompt)} tokens but the context holds "
            f"{self.max_sequence_length} (MAX_SEQUENCE_LENGTH={self.max_sequence_length}), "
            f"prompt and answer together; shorten the prompt to at most "
            f"{self.max_sequence_length - 1} tokens",
        )

    def budget(self, cap: int, prompt_tokens: int) -> int:
        """The answer's token budget: the client's cap, or the context left after the prompt
        where that is smaller (the answer then ends with finish reason "length"). The one
        place a cap becomes a budget, for every API."""
        return max(1, min(cap, self.max_sequence_length - prompt_tokens))

    def _queue(self, conn: ConnectionId, submit: Submit, setup: SetupResult) -> None:
        params = self.defaults.resolve(submit.params)
        budget = self.budget(params.max_tokens, len(setup.prompt))
        params = params.model_copy(update={"max_tokens": budget})
        request = Request(
            conn=conn,
            id=submit.id,
            seq_id=next(self._seq_ids),
            prompt=setup.prompt,
            submit=submit.model_copy(update={"params": params}),
            sampler=RequestSampler(params, setup.prompt, setup.constraint),
            answer=AnswerStream(self.tokenizer, params.stop, setup.shape),
            constraint=setup.constraint,
            arrived=time.monotonic(),
        )
        self.by_key[(conn, submit.id)] = request
        self.queue.append(request)
        self.outbox.append((conn, Started(id=submit.id, prompt_tokens=len(setup.prompt))))

    def _count(self, conn: ConnectionId, submit: Submit, prompt_tokens: int) -> None:
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
        self, conn: ConnectionId, request_id: str, code: str, message: str, param: str | None = None
    ) -> None:
        log.info("refused request %s (%s): %s", request_id, code, message)
        error = Error(id=request_id, code=code, message=message, param=param)
        self.outbox.append((conn, error))

    def keep_warm(self) -> None:
        """Queue a one-token request of rank 0's own. After minutes of idle the machine may
        let the model's memory go cold (measured: the next first token took much longer
        after a long idle, about as long with this; docs/BENCHMARKS.md, "Figures behind
        the code"); every rank steps it."""
        params = SamplingParams(max_tokens=1, temperature=0.0)
        self.submit(KEEP_WARM, Submit(id="keep-warm", prompt="Hello", params=params))

    def prime(self, tokens: list[int]) -> None:
        """Queue a one-token request of rank 0's own whose prompt is `tokens`, to put them
        in the prefix cache (the warm-up's template opening, leader/warmup.py)."""
        params = SamplingParams(max_tokens=1, temperature=0.0)
        submit = Submit(id="warm-up-head", prompt=" ", params=params)
        setup = self.setup.prepare(submit)
        self._queue(KEEP_WARM, submit, replace(setup, prompt=list(tokens)))

    @property
    def client_rows(self) -> int:
        """Rows answering a client, not rank 0's keep-warm (the socket thread reads it)."""
        return sum(1 for r in list(self.active.values()) if r.conn != KEEP_WARM)

    def cancel(self, conn: ConnectionId, request_id: str, notify: bool = True) -> None:
        """Drop a request wherever it is; it leaves the batch at the next step."""
        request = self.by_key.get((conn, request_id))
        if request is None or request.finished:
            return
        if request in self.queue:
            self.queue.remove(request)
        self.finish(request, "cancelled", notify=notify)

    def connection_closed(self, conn: ConnectionId) -> None:
        """Cancel every request of a connection that went away."""
        for key in [k for k in self.by_key if k[0] == conn]:
            self.cancel(conn, key[1], notify=False)

    def cancel_all(self, reason: FinishReason = "cancelled") -> None:
        for request in list(self.by_key.values()):
            if request in self.queue:
                self.queue.remove(request)
            self.finish(request, reason)

    # ---- endings -----------------------------------------------------------------

    def leave(self, request: Request, reason: str) -> None:
        """Take a completed request out of the batch (its Done follows when streamed);
        its prompt and answer go to the prefix cache."""
        request.finished = reason
        self.by_key.pop((request.conn, request.id), None)
        if request.seq_id in self.active:
            del self.active[request.seq_id]
            self.to_remove.append(request.seq_id)
            cached = request.prompt + request.generated[:-1]  # the last one was never fed
            self.prefix.finished(request.seq_id, cached, completed=True)

    def finish(self, request: Request, reason: FinishReason, notify: bool = True) -> None:
        """End a request now (cancelled, or failed): out of the batch, Done if `notify`."""
        request.finished = reason
        self.by_key.pop((request.conn, request.id), None)
        if request.seq_id in self.active:
            del self.active[request.seq_id]
            self.to_remove.append(request.seq_id)
            # a prompt still prefilling: the prefix cache keeps what every rank computed
            prefilling = request.prompt if request.first_token_at is None else []
            self.prefix.finished(request.seq_id, prefilling, completed=False)
        done = request.done(reason)
        if notify:
            self.outbox.append((request.conn, done))
        self.log_end(request, done, notified=notify)

    def fail(self, request: Request, exc: Exception) -> None:
        log.error("request %s failed while sampling or decoding: %r", request.id, exc)
        message = f"generation failed for this request: {exc}"
        self.outbox.append((request.conn, Error(id=request.id, code="internal", message=message)))
        if not request.ended:
            self.finish(request, "stop", notify=False)

    def log_end(self, request: Request, done: Done, notified: bool) -> None:
        log.log(
            logging.DEBUG if request.conn == KEEP_WARM else logging.INFO,
            "request %s %s: %d prompt + %d completion tokens, first token %.3f s, %.1f tok/s",
            request.id,
            done.finish_reason if notified else "cancelled (client went away)",
            done.usage.prompt_tokens,
            done.usage.completion_tokens,
            done.timings.time_to_first_token_s,
            done.timings.generation_tokens_per_second,
        )
