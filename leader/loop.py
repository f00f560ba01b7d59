"""Rank 0's step loop: socket events -> scheduler -> one step plan per step -> every rank;
results -> messages.

`Leader` is built only once the model, tokenizer, scheduler and batch engine exist, so none
of its fields is ever missing (leader/booting.py answers until then). Rank 0 alone decides
each step and broadcasts it; idle ranks sleep on the wake channel.
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, field

from config.settings import Settings
from distributed.exits import EXIT_PEER_GONE, die
from distributed.runtime import RankRuntime
from distributed.wake import WakeSender
from engine.build import LoadedRank
from engine.cpu_attention import on_cpu_backend
from engine.step_plan import StepPlan, step_width
from ipc.events import Cancelled, Closed, Event, ShutdownAsked, Submitted
from ipc.status import Counters, RankState, RankStatus, Status, StepModelStatus
from leader.booting import Boot
from leader.burst import gather_burst
from leader.requests import Requests
from leader.scheduler import Scheduler
from leader.step_times import StepTimes
from leader.warmup import WarmUp, isolated, opening, uncounted

log = logging.getLogger("ring")
# What status reports of the model config (the rest is in /model/info's facts).
REASONS = {
    RankState.READY: "serving",
    RankState.WARMING: "running their first forwards before ready (leader/warmup.py)",
    RankState.STOPPING: "a shutdown was requested",
}
CONFIG_KEYS = (
    "model_type",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
)


@dataclass(eq=False)
class Leader:
    """Rank 0 once the model is loaded: runs the step loop until told to stop."""

    settings: Settings
    runtime: RankRuntime  # this rank's identity, broadcaster and collective profiler
    boot: Boot  # the socket, its events, and when this rank started
    loaded: LoadedRank  # the model's information and the engine over it
    ranks: list[RankStatus]
    scheduler: Scheduler
    wake: WakeSender | None
    _: KW_ONLY  # the rest by name
    warm_up: WarmUp | None = None  # run before ready (leader/warmup.py); None: WARM_UP=off
    warmed: str = ""  # what the warm-up ran and how long it took, for status
    step_times: StepTimes | None = None  # the step-time model against the measured steps
    state: RankState = RankState.READY
    last_step_ms: float | None = None  # None until the first step ran
    counters: Counters = field(default_factory=Counters)
    last_work: float = field(default_factory=time.monotonic)  # the last step (keep-warm timer)
    sleeping: bool = True  # the workers wait on the wake channel
    # On MLX's CPU backend `engine.start` computes most of the step before it returns
    # (`build` is most of the step), so text streamed after it reached the clients a step
    # late: a later agent turn's first token waited for the next step's build
    # (docs/BENCHMARKS.md, "Figures behind the code"). There the text goes out first; on a
    # GPU, while the step computes.
    stream_before_start: bool = field(default_factory=on_cpu_backend)

    def __post_init__(self) -> None:
        if self.warm_up is not None:
            self.state = RankState.WARMING

    # ---- reports -----------------------------------------------------------------

    def status(self) -> Status:
        """Snapshot for the socket thread (reads plain attributes only)."""
        config = self.loaded.info.config
        return Status(
            state=self.state,
            reason=REASONS[self.state],
            warm_up=self.warmed,
            model_id=self.loaded.info.model_id,
            model_aliases=self.loaded.info.aliases,
            model_info={k: config[k] for k in CONFIG_KEYS if k in config}
            | {"path": str(self.loaded.info.path)},
            backend=self.runtime.ident.backend,
            world_size=self.runtime.ident.world_size,
            plan=self.loaded.info.plan.model_dump(mode="json"),
            ranks=self.ranks,
            active_requests=self.scheduler.requests.client_rows,
            queued_requests=len(self.scheduler.requests.queue),
            max_batch_size=self.settings.max_batch_size,
            last_step_ms=self.last_step_ms,
            counters=self.counters.model_copy(),
            kv_tokens=self.loaded.engine.kv_tokens,
            prefix_cache=self.scheduler.prefix.stats(),
            speculation=self.scheduler.speculator.stats(),
            step_model=self.step_times.status() if self.step_times else StepModelStatus(),
            max_sequence_length=self.scheduler.requests.max_sequence_length,
            uptime_s=time.monotonic() - self.boot.booting.started,
        )

    def rank_lost(self, rank: int) -> None:
        """A worker closed its wake channel: it exited, so the job cannot go on."""
        if self.state != RankState.STOPPING:
            die(EXIT_PEER_GONE, f"rank {rank} exited (its wake channel closed); stopping")

    # ---- events ------------------------------------------------------------------

    def _handle(self, event: Event) -> None:
        match event:
            case Submitted(conn, submit):
                self.scheduler.requests.submit(conn, submit)
            case Cancelled(conn, request_id):
                self.scheduler.requests.cancel(conn, request_id)
            case Closed(conn):
                self.scheduler.requests.connection_closed(conn)
            case ShutdownAsked():
                if self.state != RankState.STOPPING:
                    log.info("shutdown requested; stopping every rank")
                self.state = RankState.STOPPING

    def _stream(self) -> None:
        """Turn the tokens taken so far into messages and send them."""
        self.scheduler.stream_pending()
        self._flush()

    def _flush(self) -> None:
        if self.scheduler.requests.outbox:
            self.boot.socket.send(self.scheduler.requests.outbox)
            self.scheduler.requests.outbox = []

    def _wake_workers(self) -> None:
        if self.sleeping and self.wake is not None:
            try:
                woke_at = time.time()
                self.wake.wake()
                log.debug("woke the workers at %.6f", woke_at)
            except OSError as exc:
                die(EXIT_PEER_GONE, f"a worker rank is gone (wake channel: {exc})")
        self.sleeping = False

    def _send(self, plan: StepPlan) -> None:
        self._wake_workers()
        self.sleeping = plan.sleep or plan.stop
        self.runtime.broadcaster.broadcast(plan.encode())
        if not plan.stop:
            loaded = self.loaded.engine.apply(plan)
            self.scheduler.prefix.loaded(loaded)  # the disk loads, as the ranks voted

    # ---- the step loop -----------------------------------------------------------

    def run(self) -> None:
        if self.warm_up is not None:
            self._warm(self.warm_up)
        scheduler, engine, events = self.scheduler, self.loaded.engine, self.boot.events
        while True:
            if not scheduler.has_work(engine) and self.state != RankState.STOPPING:
                self._stream()  # the last tokens taken, before waiting for work
                if not self.sleeping:
                    self._send(scheduler.idle_plan(engine))
                    engine.advance_idle()
                try:
                    event = events.get(timeout=self._keep_warm_wait())
                except queue.Empty:
                    scheduler.requests.keep_warm()
                    continue
                if isinstance(event, Submitted):
                    self._wake_workers()  # their wake-up overlaps with tokenizing the prompt
                self._handle(event)
                if isinstance(event, Submitted):
                    self._gather_burst()
            while True:
                try:
                    self._handle(events.get_nowait())
                except queue.Empty:
                    break
            if self.state == RankState.STOPPING:
                scheduler.stream_pending()
                scheduler.requests.cancel_all()
                self._flush()
                self._send(scheduler.idle_plan(engine, stop=True))
                return
            self._flush()
            if scheduler.has_work(engine):
                self._step()

    def _warm(self, warm: WarmUp) -> None:
        """Run the warm-up's requests to their end, then say ready (a shutdown asked
        meanwhile ends it early: the step loop then stops every rank)."""
        started = time.perf_counter()
        scheduler = self.scheduler
        with isolated(scheduler):
            if not self._warm_steps(warm, warm.submit_next):
                return
        head = opening(scheduler.requests)
        if head:
            with uncounted(scheduler.prefix):
                scheduler.requests.prime(head)
                if not self._warm_steps(warm, lambda _: False):
                    return
        seconds = time.perf_counter() - started
        self.warmed = f"{warm.submitted} requests in {warm.steps} steps, {seconds:.2f} s"
        if head:
            self.warmed += f"; the chat template's first {len(head)} tokens cached"
        self.counters, self.last_step_ms = Counters(), None
        self.state = RankState.READY
        log.info("warm-up: %s", self.warmed)

    def _warm_steps(self, warm: WarmUp, submit_next: Callable[[Requests], bool]) -> bool:
        """Step the warm-up's requests to their end, `submit_next` queueing more while it
        says so; False where a shutdown was asked meanwhile."""
        scheduler, engine = self.scheduler, self.loaded.engine
        while self.state == RankState.WARMING:
            while True:  # submits are refused while warming (ipc/server.py)
                try:
                    self._handle(self.boot.events.get_nowait())
                except queue.Empty:
                    break
            if self.state != RankState.WARMING:
                return False
            if scheduler.has_work(engine):
                self._step(warm)
            elif not submit_next(scheduler.requests):
                break
        self._stream()  # their last tokens: sent to no connection
        return True

    def _gather_burst(self) -> None:
        """Take the requests that follow one to an idle cluster (BURST_WINDOW_MS)."""
        window = self.settings.burst_window_ms / 1000
        gathered = gather_burst(self.boot.events, self._handle, window)
        if gathered:
            log.debug("burst: %d more requests came with the first", gathered)

    def _step(self, warm: WarmUp | None = None) -> None:
        scheduler, engine = self.scheduler, self.loaded.engine
        started = time.perf_counter()
        before = (self.runtime.broadcaster.collective_seconds, self._forward_collectives())
        plan = scheduler.build_plan(engine)
        if warm is not None:
            removed = set(plan.removes)
            decoding = [s for s in engine.decode_ids if s not in removed]
            warm.adjust(plan, decoding, scheduler.requests)
        if not plan.inserts and engine.size == len(set(plan.removes)):
            plan.sleep = True
        self._send(plan)
        if plan.sleep:
            engine.advance_idle()
            self._stream()
            return
        planned = time.perf_counter()
        if self.stream_before_start:
            self._stream()  # the previous step's text
        streamed_first = time.perf_counter()
        step = engine.start(scheduler.sampling_rows)
        launched = time.perf_counter()
        if not self.stream_before_start:
            self._stream()  # the previous step's text, while this step computes
        streamed = time.perf_counter()
        result = step.wait()
        computed = time.perf_counter()
        self.last_work = time.monotonic()
        accepted = scheduler.speculator.totals.accepted
        scheduler.on_result(result)
        accepted = scheduler.speculator.totals.accepted - accepted  # speculation's extra tokens
        width = step_width(plan.drafts)
        if plan.tokens and not result.prefill_tokens and warm is None:  # the rule's costs
            ms = (launched - streamed_first + computed - streamed) * 1000
            scheduler.speculator.observe(len(plan.tokens) * width, result.eager, ms)
        scheduler.prefix.bytes = result.prefix_bytes
        self.counters.steps += 1
        self.counters.decode_tokens += len(plan.tokens) + accepted
        self.counters.prefill_tokens += result.prefill_tokens
        self._flush()
        done = time.perf_counter()
        self.last_step_ms = (done - started) * 1000
        if self.step_times is not None and warm is None:
            self._time_step(plan, result.prefill_tokens, result.prefill_forwards, width)
        if scheduler.prefill_budget is not None and warm is None:
            # the whole step, as the answers' inter-token latency sees it; a speculative
            # step's decode part counts as rows x positions (skipping those steps starved
            # a long prompt beside speculating answers of all credit; docs/BENCHMARKS.md,
            # "Figures behind the code")
            scheduler.prefill_budget.observe(
                len(plan.tokens) * width,
                result.prefill_forwards,
                self.last_step_ms,
                waiting=plan.prefill is not None,
            )
        if log.isEnabledFor(logging.DEBUG):
            after = (self.runtime.broadcaster.collective_seconds, self._forward_collectives())
            times = (started, planned, streamed_first, launched, streamed, computed, done)
            self._log_step(plan, result.prefill_tokens, times, before, after)

    def _time_step(
        self, plan: StepPlan, prefill: int, forwards: list[tuple[int, int]], width: int
    ) -> None:
        """The step beside its prediction: decode-only steps at their widest row's context
        (the batch's caches attend over it), prefill-only steps forward by forward."""
        assert self.step_times is not None and self.last_step_ms is not None
        if plan.tokens and not prefill:
            context = max(self.loaded.engine.decode_lengths, default=0)
            self.step_times.decoded(len(plan.tokens), width, context, self.last_step_ms)
        elif prefill and not plan.tokens:
            self.step_times.prefilled(forwards, self.last_step_ms)

    def _keep_warm_wait(self) -> float | None:
        """Seconds until the next keep-warm request (None: never); counted from the last
        step, so events that make no work (a status check's closed connection) don't
        postpone it."""
        if not self.settings.keep_warm_seconds:
            return None
        return max(0.0, self.last_work + self.settings.keep_warm_seconds - time.monotonic())

    def _forward_collectives(self) -> tuple[float, int]:
        profiler = self.runtime.profiler
        return (profiler.seconds, profiler.count) if profiler else (0.0, 0)

    def _log_step(
        self,
        plan: StepPlan,
        prefill: int,
        times: tuple[float, ...],
        before: tuple[float, tuple[float, int]],
        after: tuple[float, tuple[float, int]],
    ) -> None:
        started, planned, streamed_first, launched, streamed, computed, done = times
        log.debug(
            "step %d: decode %d (+%d proposed), prefill %d tokens; total %.2f ms = plan+broadcast "
            "%.2f (all_sum %.2f) + build %.2f + stream %.2f + wait %.2f (all_sum %.2f in %d) "
            "+ take %.2f",
            plan.step,
            len(plan.tokens),
            sum(len(draft) for draft in plan.drafts),
            prefill,
            (done - started) * 1000,
            (planned - started) * 1000,
            (after[0] - before[0]) * 1000,
            (launched - streamed_first) * 1000,
            (streamed_first - planned + streamed - launched) * 1000,
            (computed - streamed) * 1000,
            (after[1][0] - before[1][0]) * 1000,
            after[1][1] - before[1][1],
            (done - computed) * 1000,
        )
