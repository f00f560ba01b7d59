"""Rank 0's scheduler: which queued requests join the batch, each step's plan, how to
sample each row, and the sampled tokens taken into their requests' messages.

Only rank 0 runs this. It admits requests from leader/requests.py (which holds them from
arrival to end) under the batch size and the prefix cache's decisions, plans every step
(removes, next tokens, speculation's proposals, inserts, cache operations, the prefill
budget), tells the engine how to sample each row, and takes every row's sampled tokens,
ending requests at EOS, max_tokens, a stop string or a complete grammar
(leader/request.py). Constraints change only which token rank 0 samples, never what any
rank computes.
"""

from __future__ import annotations

import logging
import time

from engine.batch_engine import BatchEngine
from engine.batch_sampler import RowSampling
from engine.step_plan import StepPlan, StepResult, step_width
from ipc.protocol import Done
from leader.prefill_budget import PrefillBudget
from leader.prefix_cache import PlanOps, PrefixCache
from leader.request import Ending, Request
from leader.requests import Requests
from leader.sampler import Sample
from leader.speculation import Speculator

log = logging.getLogger("ring.scheduler")


class Scheduler:
    """Queue and batch decisions; every method runs on rank 0's main thread."""

    def __init__(
        self,
        requests: Requests,
        max_batch_size: int,
        *,
        speculator: Speculator | None = None,
        prefill_budget: PrefillBudget | None = None,
    ) -> None:
        self.requests = requests
        self.speculator = speculator or Speculator(0)
        self.prefill_budget = prefill_budget  # None: every step takes PREFILL_CHUNK_SIZE
        self.max_batch_size = max_batch_size
        tokenizer = requests.tokenizer
        self.eos_ids = set(getattr(tokenizer, "eos_token_ids", None) or [])
        if tokenizer.eos_token_id is not None:
            self.eos_ids.add(tokenizer.eos_token_id)
        self.next_token: dict[int, int] = {}
        # tokens taken but not streamed yet: (request, its sample, the end it made)
        self.streaming: list[tuple[Request, Sample, Ending | None]] = []

    @property
    def prefix(self) -> PrefixCache:
        """The prefix cache's decisions: its requests' (one object, which the warm-up
        swaps for none while it runs)."""
        return self.requests.prefix

    # ---- step plans --------------------------------------------------------------

    def has_work(self, engine: BatchEngine) -> bool:
        requests = self.requests
        return bool(requests.queue or requests.to_remove or engine.size)

    def build_plan(self, engine: BatchEngine) -> StepPlan:
        """The next plan: prefix-cache stores and evictions, removes, next tokens of the
        decode batch, admitted inserts (a request may wait for a prefix being stored)."""
        rollbacks = self.speculator.rollbacks(engine.decode_ids)
        requests = self.requests
        removes, requests.to_remove = requests.to_remove, []
        removed = set(removes)
        decoding = [s for s in engine.decode_ids if s not in removed]
        tokens = [self.next_token.pop(s) for s in decoding]
        drafts = self.speculator.drafts(decoding, requests.active)
        width = step_width(drafts)
        for seq_id in removed:
            self.next_token.pop(seq_id, None)
        ops = PlanOps()
        self.prefix.plan_stores(ops, {p.seq_id: p.length for p in engine.prefilling})
        room = self.max_batch_size - (engine.size - len(removed))
        inserts = []
        admitted = []
        for request in list(requests.queue):
            if room <= 0:
                break
            insert = self.prefix.admit(request.seq_id, request.prompt, ops)
            if insert is None:
                continue  # a prefilling request is about to store most of its prompt
            requests.queue.remove(request)
            requests.active[request.seq_id] = request
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
        plan = StepPlan(
            engine.step_index,
            engine.fingerprint(),
            removes=removes,
            tokens=tokens,
            inserts=inserts,
            drafts=drafts,
            rollbacks=rollbacks,
            prefill=self._prefill_tokens(engine, removed, len(decoding) * width, inserts),
        )
        return ops.carried_by(plan)

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
            request = self.requests.active.get(seq_id)
            row = RowSampling()  # any token will do: the sequence leaves next step
            if request is not None and not request.finished:
                try:
                    row = request.sampler.row()
                except Exception as exc:  # one request's trouble must never stop the loop
                    self.requests.fail(request, exc)
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
            request = self.requests.active.get(seq_id)
            if self.speculator.enabled:  # the accepted run (leader/speculation.py)
                run = run[: self.speculator.accept(seq_id, [r[0] for r in run], request)]
            self.next_token[seq_id] = run[-1][0]
            if request is None or request.finished:
                continue  # removed next step
            if request.first_token_at is not None:
                self.speculator.count(request, len(run))
            for index, (token, logprob, top) in enumerate(run):
                accepted = index + 1 < len(run)  # the run's last token is the step's own
                if not self._take(request, Sample(token, logprob, top, accepted), now):
                    break

    def _take(self, request: Request, drawn: Sample, now: float) -> bool:
        """Take one sampled token of a request; False once the request ended."""
        params = request.submit.params
        logprob = drawn.logprob if params.logprobs else None
        sample = Sample(drawn.token, logprob, drawn.top[: params.top_logprobs], drawn.accepted)
        token = drawn.token
        if request.first_token_at is None:
            request.first_token_at = now
            self.prefix.prefilled(request.seq_id)
        try:
            ending = request.take(token, self.eos_ids)
        except Exception as exc:
            self.requests.fail(request, exc)
            return False
        self.streaming.append((request, sample, ending))
        if ending is not None:
            self.requests.leave(request, "length" if ending == "length" else "stop")
        return ending is None

    def stream_pending(self) -> None:
        """Text, reasoning and tool calls of the tokens taken so far, as messages."""
        items, self.streaming = self.streaming, []
        for request, sample, ending in items:
            if request.ended:
                continue
            try:
                messages, stopped = request.stream(sample, ending, self.requests.tokenizer)
            except Exception as exc:
                self.requests.fail(request, exc)
                continue
            if stopped and not request.finished:
                self.requests.leave(request, "stop")
            self.requests.outbox += [(request.conn, message) for message in messages]
            for message in messages:
                if isinstance(message, Done):
                    self.requests.log_end(request, message, notified=True)
