"""Rank 0 before its model is loaded: the socket answers at once (status says loading, with
every rank's progress as far as it reported it; submits are refused), and SIGTERM or
SIGINT leave at once while loading, or stop every rank cleanly once serving."""

from __future__ import annotations

import logging
import queue
import signal
import time
from dataclasses import dataclass, field

from config.settings import Settings
from distributed.exits import die
from distributed.group import RankIdentity
from ipc.events import Event, ShutdownAsked
from ipc.server import SocketServer
from ipc.status import LoadProgress, RankState, Status


@dataclass
class Booting:
    """Rank 0's status until the leader takes over."""

    settings: Settings
    ident: RankIdentity
    started: float = field(default_factory=time.monotonic)
    state: RankState = RankState.LOADING
    progress: dict[int, LoadProgress] = field(default_factory=dict)

    def on_progress(self, rank: int, done: int, total: int) -> None:
        """Any thread: rank `rank` has materialized `done` of its `total` layers."""
        self.progress = self.progress | {rank: LoadProgress(rank=rank, done=done, total=total)}

    def status(self) -> Status:
        model = self.settings.model or "the default model"
        return Status(
            state=self.state,
            reason=f"loading {model} on {self.ident.world_size} rank(s)",
            model_id=self.settings.model,
            backend=self.ident.backend,
            world_size=self.ident.world_size,
            max_batch_size=self.settings.max_batch_size,
            max_sequence_length=self.settings.max_sequence_length or 0,
            uptime_s=time.monotonic() - self.started,
            loading=[self.progress[rank] for rank in sorted(self.progress)],
        )


@dataclass(frozen=True)
class Boot:
    """Rank 0's socket, up before the model loads, and the events it puts on the queue."""

    booting: Booting
    socket: SocketServer
    events: queue.Queue[Event]


def boot(settings: Settings, ident: RankIdentity) -> Boot:
    """Serve the socket (status while loading) and take over SIGTERM and SIGINT."""
    events: queue.Queue[Event] = queue.Queue()
    booting = Booting(settings, ident)
    socket = SocketServer(settings.socket_path, events, booting)
    socket.start()

    def on_signal(signum: int, _frame: object) -> None:
        """While loading, leave at once; later, stop every rank cleanly."""
        if socket.reporter is booting:
            socket.close()
            name = signal.Signals(signum).name
            die(0, f"{name} while loading the model; exiting", logging.INFO)
        events.put(ShutdownAsked())

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    return Boot(booting, socket, events)
