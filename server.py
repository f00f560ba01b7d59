"""Entry for every rank: group setup, model load, the lock-step step loop.

Rank 0 owns the socket, tokenizer, scheduler and sampler; it broadcasts one step plan
per step and every rank applies it and runs the forward pass. Idle ranks block on the
wake channel (no spinning); SIGTERM or a shutdown message ends every rank with exit 0.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import sys
import time

import mlx.core as mx

from config import Settings, load_settings
from config.logging_setup import setup_logging
from distributed.broadcast import Broadcaster
from distributed.group import RankIdentity, init_group, leader_address
from distributed.profile import CollectiveProfiler
from distributed.wake import WakeError, WakeReceiver, WakeSender, open_wake_channel
from distributed.watchdog import CollectiveWatchdog
from engine.batch_engine import BatchEngine, PlanMismatchError
from engine.model_loading import ModelInfo, ModelLoadError, load_for_rank
from engine.scheduler import Scheduler
from engine.step_plan import PlanDecodeError, StepPlan
from ipc.protocol import RankStatus, Status
from ipc.server import Event, SocketServer

EXIT_BAD_MODEL = 2
EXIT_DIVERGED = 4
EXIT_PEER_GONE = 5
log = logging.getLogger("ring")


def _detach_stdin() -> None:
    """Close the pipe mlx.launch relays stdin into (it busy-loops while that stays open)."""
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)


def _die(code: int, message: str, level: int = logging.ERROR) -> None:
    """Log one line and end the process now (threads blocked in MLX cannot be joined)."""
    log.log(level, message)
    for handler in logging.getLogger().handlers:
        handler.flush()
    os._exit(code)


class Leader:
    """Rank 0: socket events -> scheduler -> plans; results -> messages."""

    def __init__(self, settings: Settings, ident: RankIdentity) -> None:
        self.settings = settings
        self.ident = ident
        self.events: queue.Queue[Event] = queue.Queue()
        self.state = "loading"
        self.started = time.monotonic()
        self.info: ModelInfo | None = None
        self.ranks: list[RankStatus] = [RankStatus(rank=0, host=ident.host)]
        self.scheduler: Scheduler | None = None
        self.engine: BatchEngine | None = None
        self.last_step_ms: float | None = None
        self.last_work = time.monotonic()  # when the last step ran (keep-warm timer)
        self.socket = SocketServer(settings.socket_path, self.events, self.status, self.model_id)
        self.profiler: CollectiveProfiler | None = None

    def on_signal(self, signum: int, _frame: object) -> None:
        """SIGTERM/SIGINT: stop every rank cleanly; while still loading, just leave."""
        if self.state == "loading":
            self.socket.close()
            name = signal.Signals(signum).name
            _die(0, f"{name} while loading the model; exiting", logging.INFO)
        self.events.put(Event("shutdown"))

    def rank_lost(self, rank: int) -> None:
        """A worker closed its wake channel: it exited, so the job cannot go on."""
        if self.state != "stopping":
            _die(EXIT_PEER_GONE, f"rank {rank} exited (its wake channel closed); stopping")

    def model_id(self) -> str:
        return self.info.model_id if self.info else self.settings.model

    def status(self) -> Status:
        """Snapshot for the socket thread (reads plain attributes only)."""
        scheduler, engine = self.scheduler, self.engine
        config = self.info.config if self.info else {}
        keys = (
            "model_type",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "vocab_size",
        )
        return Status(
            state=self.state,
            model_id=self.model_id(),
            model_info={k: config[k] for k in keys if k in config}
            | ({"path": self.info.path} if self.info else {}),
            backend=self.ident.backend,
            world_size=self.ident.world_size,
            plan=self.info.plan if self.info else {},
            ranks=self.ranks,
            active_requests=engine.size if engine else 0,
            queued_requests=len(scheduler.queue) if scheduler else 0,
            max_batch_size=self.settings.max_batch_size,
            last_step_ms=self.last_step_ms,
            max_sequence_length=self.settings.max_sequence_length,
            uptime_s=time.monotonic() - self.started,
        )

    def _handle(self, event: Event) -> None:
        if event.kind == "submit":
            self.scheduler.submit(event.conn, event.message)
        elif event.kind == "cancel":
            self.scheduler.cancel(event.conn, event.message.id)
        elif event.kind == "closed":
            self.scheduler.connection_closed(event.conn)
        elif event.kind == "shutdown":
            if self.state != "stopping":
                log.info("shutdown requested; stopping every rank")
            self.state = "stopping"
            self.socket.stopping = True

    def _flush(self) -> None:
        if self.scheduler.outbox:
            self.socket.send(self.scheduler.outbox)
            self.scheduler.outbox = []

    def run(self, engine: BatchEngine, broadcaster: Broadcaster, wake: WakeSender | None) -> None:
        scheduler, events = self.scheduler, self.events
        sleeping = True

        def wake_workers() -> None:
            nonlocal sleeping
            if sleeping and wake is not None:
                try:
                    woke_at = time.time()
                    wake.wake()
                    log.debug("woke the workers at %.6f", woke_at)
                except OSError as exc:
                    _die(EXIT_PEER_GONE, f"a worker rank is gone (wake channel: {exc})")
            sleeping = False

        def send(plan: StepPlan) -> None:
            nonlocal sleeping
            wake_workers()
            sleeping = plan.sleep or plan.stop
            broadcaster.broadcast(plan.encode())
            if not plan.stop:
                engine.apply(plan)

        while True:
            if not scheduler.has_work(engine) and self.state != "stopping":
                if not sleeping:
                    send(scheduler.idle_plan(engine))
                    engine.advance_idle()
                try:
                    event = events.get(timeout=self._keep_warm_wait())
                except queue.Empty:
                    scheduler.keep_warm()
                    continue
                if event.kind == "submit":
                    wake_workers()  # their wake-up overlaps with tokenizing the prompt
                self._handle(event)
            while True:
                try:
                    self._handle(events.get_nowait())
                except queue.Empty:
                    break
            if self.state == "stopping":
                scheduler.cancel_all()
                self._flush()
                send(scheduler.idle_plan(engine, stop=True))
                return
            self._flush()
            if not scheduler.has_work(engine):
                continue
            started = time.perf_counter()
            before = (broadcaster.collective_seconds, self._forward_collectives())
            plan = scheduler.build_plan(engine)
            if not plan.inserts and engine.size == len(set(plan.removes)):
                plan.sleep = True
            send(plan)
            if plan.sleep:
                engine.advance_idle()
                continue
            planned = time.perf_counter()
            result = engine.run()
            computed = time.perf_counter()
            self.last_work = time.monotonic()
            scheduler.on_result(result)
            self._flush()
            done = time.perf_counter()
            self.last_step_ms = (done - started) * 1000
            if log.isEnabledFor(logging.DEBUG):
                after = (broadcaster.collective_seconds, self._forward_collectives())
                times = (started, planned, computed, done)
                self._log_step(plan, result.prefill_tokens, times, before, after)

    def _keep_warm_wait(self) -> float | None:
        """Seconds until the next keep-warm request (None: never); counted from the last
        step, so events that make no work (a status check's closed connection) don't
        postpone it."""
        if not self.settings.keep_warm_seconds:
            return None
        return max(0.0, self.last_work + self.settings.keep_warm_seconds - time.monotonic())

    def _forward_collectives(self) -> tuple[float, int]:
        profiler = self.profiler
        return (profiler.seconds, profiler.count) if profiler else (0.0, 0)

    def _log_step(self, plan: StepPlan, prefill: int, times: tuple, before, after) -> None:
        started, planned, computed, done = times
        log.debug(
            "step %d: decode %d, prefill %d tokens; total %.2f ms = plan+broadcast "
            "%.2f (all_sum %.2f) + forward %.2f (all_sum %.2f in %d) + sample/stream %.2f",
            plan.step,
            len(plan.tokens),
            prefill,
            (done - started) * 1000,
            (planned - started) * 1000,
            (after[0] - before[0]) * 1000,
            (computed - planned) * 1000,
            (after[1][0] - before[1][0]) * 1000,
            after[1][1] - before[1][1],
            (done - computed) * 1000,
        )


def _worker_loop(engine: BatchEngine, broadcaster: Broadcaster, wake: WakeReceiver) -> None:
    while True:
        try:
            wake.wait()
            log.debug("woken at %.6f", time.time())
        except WakeError as exc:
            _die(EXIT_PEER_GONE, f"{exc}; this rank exits")
        while True:
            try:
                plan = StepPlan.decode(broadcaster.broadcast(None))
                engine.check(plan)
                if plan.stop:
                    log.info("stop plan received; exiting")
                    return
                engine.apply(plan)
            except (PlanDecodeError, PlanMismatchError) as exc:
                _die(EXIT_DIVERGED, f"stopping the job: {exc}")
            if plan.sleep:
                engine.advance_idle()
                break
            engine.run()


def main() -> int:
    _detach_stdin()
    settings = load_settings()
    group, ident = init_group(settings.distributed_backend)
    setup_logging(settings.log_level, ident.role)
    log.info(
        "rank %d of %d on %s (backend %s)", ident.rank, ident.world_size, ident.host, ident.backend
    )
    watchdog = CollectiveWatchdog(settings.collective_timeout_seconds)
    broadcaster = Broadcaster(group, watchdog)
    leader = Leader(settings, ident) if ident.is_leader else None
    if os.environ.get("RING_PROFILE_COLLECTIVES") == "1":
        profiler = CollectiveProfiler().install()  # every rank: same sync points
        if leader:
            leader.profiler = profiler
    if leader:
        leader.socket.start()
        signal.signal(signal.SIGTERM, leader.on_signal)
        signal.signal(signal.SIGINT, leader.on_signal)
    else:
        # Ctrl-C reaches every rank of a terminal's job; rank 0 alone decides when to stop.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        wake = open_wake_channel(broadcaster, leader_address())
        model, tokenizer, info = load_for_rank(settings, group)
    except WakeError as exc:
        _die(EXIT_PEER_GONE, str(exc))
    except ModelLoadError as exc:
        _die(EXIT_BAD_MODEL, f"cannot load the model: {exc}")
    engine = BatchEngine(model, settings.prefill_chunk_size, watchdog.guard)
    mine = RankStatus(
        rank=ident.rank,
        host=ident.host,
        share=info.share,
        weight_bytes=info.weight_bytes,
        memory_bytes=mx.get_active_memory(),
    )
    if not leader:
        assert isinstance(wake, WakeReceiver)
        wake.send_ready(mine.model_dump())
        log.info("ready; waiting for work")
        _worker_loop(engine, broadcaster, wake)
        return 0
    reports = wake.collect_ready() if wake is not None else []
    if wake is not None:
        wake.watch(leader.rank_lost)
    leader.info = info
    leader.ranks = [mine] + [RankStatus.model_validate(report) for report in reports]
    leader.scheduler = Scheduler(tokenizer, settings.max_batch_size, settings.max_sequence_length)
    leader.engine = engine
    leader.state = "ready"
    leader.socket.accepting = True
    log.info(
        "ready: %s on %d rank(s); socket %s", info.model_id, ident.world_size, settings.socket_path
    )
    leader.run(engine, broadcaster, wake)
    leader.socket.close()
    log.info("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
