"""Rank 0's scheduler: request queue, admission, step plans, sampled tokens -> messages.

Only rank 0 runs this. It turns socket events into step plans, tells the engine how to
sample each row, and turns the sampled tokens into Delta/Done messages (engine/request.py),
enforcing EOS, max_tokens, stop strings, grammar constraints and the prompt-length limit
(a refused prompt is answered here and never broadcast). Constraints change only which
token rank 0 samples, never what any rank computes.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from typing import Any

from engine.answer import AnswerStream
from engine.batch_engine import BatchEngine, StepResult
from engine.batch_sampler import RowSampling
from engine.constraints import GrammarTokens
from engine.prefill_budget import PrefillBudget
from engine.prefix_cache import PlanOps, PrefixCache
from engine.request import Ending, Request
from engine.request_setup import Refusal, RequestSetup, SetupResult
from engine.sampler import RequestSampler, Sample
from engine.sampling_defaults import SamplingDefaults
from engine.speculation import Speculator
from engine.step_plan import StepPlan, step_width
from ipc.protocol import (
    Done,
    Error,
    FinishReason,
    SamplingParams,
    Started,
    Submit,
    Timings,
    Usage,
)

log = logging.getLogger("ring.scheduler")
KEEP_WARM_CONN = -1  # rank 0's own keep-warm requests: no connection, nothing is sent

Outbox = list[tuple[Any, Any]]  # (connection key, message)


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
        vocab_size: int | None = None,
        speculator: Speculator | None = None,
        prefill_budget: PrefillBudget | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.setup = RequestSetup(tokenizer, grammar, vocab_size)
        self.defaults = defaults or SamplingDefaults()
        self.prefix = prefix or PrefixCache(0)
        self.speculator = speculator or Speculator(0)
        self.prefill_budget = prefill_budget  # None: every step takes PREFILL_CHUNK_SIZE
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
        # tokens taken but not streamed yet: (request, its sample, the end it made)
        self.streaming: list[tuple[Request, Sample, Ending | None]] = []

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

    def _queue(self, conn: Any, submit: Submit, setup: SetupResult) -> None:
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

    @property
    def client_rows(self) -> int:
        """Rows answering a client, not rank 0's keep-warm (the socket thread reads it)."""
        return sum(1 for r in list(self.active.values()) if r.conn != KEEP_WARM_CONN)

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

    def cancel_all(self, reason: FinishReason = "cancelled") -> None:
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
        rollbacks = self.speculator.rollbacks(engine.decode_ids)
        removes, self.to_remove = self.to_remove, []
        removed = set(removes)
        decoding = [s for s in engine.decode_ids if s not in removed]
        tokens = [self.next_token.pop(s) for s in decoding]
        drafts = self.speculator.drafts(decoding, self.active)
        width = step_width(drafts)
        for seq_id in removed:
            self.next_token.pop(seq_id, None)
        ops = PlanOps()
        self.prefix.plan_stores(ops)
        room = self.max_batch_size - (engine.size - len(removed))
        inserts = []
        admitted = []
        for request in list(self.queue):
            if room <= 0:
                break
            insert = self.prefix.admit(request.seq_id, request.prompt, ops)
            if insert is None:
                continue  # a prefilling request is about to store most of its prompt
            self.queue.remove(request)
            self.active[request.seq_id] = request
            inserts.append(insert)
            admitted.append(request)
            room -= 1
        if not engine.prefilling:  # else the engine's group could not start with these
            prompts = [request.prompt for request in admitted]
            self.prefix.align_burst(inserts, prompts, engine.prefill_chunk_size)
        for request, insert in zip(admitted, inserts, strict=True):
            request.prefix_len = insert.prefix_len
            if insert.prefix_len:
                log.debug(
                    "prefix hit for request %s: %d of %d prompt tokens from entry %d",
                    request.id,
                    insert.prefix_len,
                    len(request.prompt),
                    insert.prefix_entry,
                )
        return StepPlan(
            step=engine.step_index,
            fingerprint=engine.fingerprint(),
            removes=removes,
            tokens=tokens,
            inserts=inserts,
            stores=ops.stores,
            evicts=ops.evicts,
            drafts=drafts,
            rollbacks=rollbacks,
            prefill=self._prefill_tokens(engine, removed, len(decoding) * width, inserts),
            saves=ops.saves,
            loads=ops.loads,
            drops=ops.drops,
        )

    def _prefill_tokens(
        self, engine: BatchEngine, removed: set[int], rows: int, inserts: list
    ) -> int | None:
        """The step's prefill tokens beside `rows` decode positions (None: the engine's)."""
        if self.prefill_budget is None:
            return None
        pending = [
            (p.length, len(p.tokens) - p.position)
            for p in engine.prefilling
            if p.seq_id not in removed
        ]
        pending += [(insert.prefix_len, len(insert.tokens)) for insert in inserts]
        return self.prefill_budget.tokens(rows, pending) if pending else None

    def idle_plan(self, engine: BatchEngine, stop: bool = False) -> StepPlan:
        """A plan that runs no compute: all ranks go to sleep (or stop)."""
        return StepPlan(
            step=engine.step_index,
            fingerprint=engine.fingerprint(),
            sleep=not stop,
            stop=stop,
        )

    # ---- sampling and results ---------------------------------------------------

    def sampling_rows(
        self, seq_ids: list[int], widths: list[int] | None = None
    ) -> list[RowSampling]:
        """How to sample each row of a step (the engine asks while it builds the step);
        `widths`: each sequence's positions (default one each)."""
        rows: list[RowSampling] = []
        for seq_id, width in zip(seq_ids, widths or [1] * len(seq_ids), strict=True):
            request = self.active.get(seq_id)
            row = RowSampling()  # any token will do: the sequence leaves next step
            if request is not None and not request.finished:
                try:
                    row = request.sampler.row()
                except Exception as exc:  # one request's trouble must never stop the loop
                    self._fail(request, exc)
            rows.append(row)
            if width > 1:  # a speculative step's later positions
                rows += self.speculator.sampling(seq_id, width, request)
        return rows

    def on_result(self, result: StepResult) -> None:
        """Take every row's sampled token: record it and end the requests whose end needs
        no text; their text is streamed by `stream_pending`, while the next step runs."""
        if result.sampled is None:
            return
        now = time.monotonic()
        rows, at = result.sampled.rows(), 0
        widths = result.widths or [1] * len(result.seq_ids)
        for seq_id, width in zip(result.seq_ids, widths, strict=True):
            run, at = rows[at : at + width], at + width
            request = self.active.get(seq_id)
            if width > 1:  # a speculative step: the accepted run (engine/speculation.py)
                run = run[: self.speculator.accept(seq_id, [r[0] for r in run], request)]
            self.next_token[seq_id] = run[-1][0]
            if request is None or request.finished:
                continue  # removed next step
            if request.first_token_at is not None:
                self.speculator.count(request, len(run))
            for token, logprob, top in run:
                if not self._take(request, token, logprob, top, now):
                    break

    def _take(
        self, request: Request, token: int, logprob: float | None, top: list, now: float
    ) -> bool:
        """Take one sampled token of a request; False once the request ended."""
        params = request.submit.params
        sample = Sample(token, logprob if params.logprobs else None, top[: params.top_logprobs])
        if request.first_token_at is None:
            request.first_token_at = now
            self.prefix.prefilled(request.seq_id)
        try:
            ending = request.take(token, self.eos_ids)
        except Exception as exc:
            self._fail(request, exc)
            return False
        self.streaming.append((request, sample, ending))
        if ending is not None:
            self._leave(request, "length" if ending == "length" else "stop")
        return ending is None

    def stream_pending(self) -> None:
        """Text, reasoning and tool calls of the tokens taken so far, as messages."""
        items, self.streaming = self.streaming, []
        for request, sample, ending in items:
            if request.ended:
                continue
            try:
                messages, stopped = request.stream(sample, ending, self.tokenizer)
            except Exception as exc:
                self._fail(request, exc)
                continue
            if stopped and not request.finished:
                self._leave(request, "stop")
            self.outbox += [(request.conn, message) for message in messages]
            for message in messages:
                if isinstance(message, Done):
                    self._log_end(request, message, notified=True)

    def _leave(self, request: Request, reason: str) -> None:
        """Take a completed request out of the batch (its Done follows when streamed);
        its prompt and answer go to the prefix cache."""
        request.finished = reason
        self.by_key.pop((request.conn, request.id), None)
        if request.seq_id in self.active:
            del self.active[request.seq_id]
            self.to_remove.append(request.seq_id)
            cached = request.prompt + request.generated[:-1]  # the last one was never fed
            self.prefix.finished(request.seq_id, cached, completed=True)

    def _finish(self, request: Request, reason: FinishReason, notify: bool = True) -> None:
        """End a request now (cancelled, or failed): out of the batch, Done if `notify`."""
        request.finished = reason
        self.by_key.pop((request.conn, request.id), None)
        if request.seq_id in self.active:
            del self.active[request.seq_id]
            self.to_remove.append(request.seq_id)
            self.prefix.finished(request.seq_id, [], completed=False)
        done = request.done(reason)
        if notify:
            self.outbox.append((request.conn, done))
        self._log_end(request, done, notified=notify)

    def _fail(self, request: Request, exc: Exception) -> None:
        log.error("request %s failed while sampling or decoding: %r", request.id, exc)
        message = f"generation failed for this request: {exc}"
        self.outbox.append((request.conn, Error(id=request.id, code="internal", message=message)))
        if not request.ended:
            self._finish(request, "stop", notify=False)

    def _log_end(self, request: Request, done: Done, notified: bool) -> None:
        log.log(
            logging.DEBUG if request.conn == KEEP_WARM_CONN else logging.INFO,
            "request %s %s: %d prompt + %d completion tokens, first token %.3f s, %.1f tok/s",
            request.id,
            done.finish_reason if notified else "cancelled (client went away)",
            done.usage.prompt_tokens,
            done.usage.completion_tokens,
            done.timings.time_to_first_token_s,
            done.timings.generation_tokens_per_second,
        )
