"""The supervisor's state file: what launcher/supervisor.py is doing about the ranks.

The supervisor writes it (run/supervisor.json, atomically: a temporary file renamed over
the old one) at every change; api.py reads it for /health, /cluster/status and
Retry-After, and `./launch.sh status` prints its summary. The reader trusts a file only
while the pid it names is alive, so a killed supervisor is never reported as running.
Standard library and pydantic only: api.py never imports mlx.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ValidationError

from ipc.processes import pid_alive

# starting: the first start; running: the ranks serve; restarting: they ended and the
# supervisor starts them again (attempt, next_try_at); failed: it gave up (reason);
# stopping/stopped: `./launch.sh stop`.
Phase = Literal["starting", "running", "restarting", "failed", "stopping", "stopped"]
HISTORY = 20  # failures kept in the file
# The supervisor gives api.py the file's path in this variable (not a setting: only the
# supervisor sets it; an api.py started without it reports the ranks alone).
STATE_ENV = "MLX_RING_SUPERVISOR_STATE"


class Failure(BaseModel):
    """One thing that ended: the ranks' job or api.py."""

    at: float  # unix time
    what: Literal["ranks", "api"]
    reason: str


class LeftOut(BaseModel):
    """A worker the current job runs without (DEGRADED_MODE=auto)."""

    rank: int  # its rank in the full cluster (WORKER_HOSTS order + 1)
    host: str  # its SSH destination
    reason: str


class TransferView(BaseModel):
    """One worker's model transfer before a start (launcher/transfer.py)."""

    rank: int  # its rank in the job
    host: str  # its SSH destination
    phase: Literal["checking", "sending", "done", "refused", "failed"]
    share: str = ""  # what it receives, in the plan's words
    done_bytes: int = 0  # on the worker, checked
    total_bytes: int = 0  # its share (or the whole model)
    rate: float = 0.0  # bytes per second, this transfer
    eta_s: float | None = None
    note: str = ""  # done: how (nothing to send, a full copy there); refused/failed: why

    def line(self) -> str:
        """One line for people: who, how far, how fast, how long left."""
        who = f"rank {self.rank} ({self.host})"
        if self.phase == "checking":
            return f"{who}: checking what it holds"
        if self.phase in ("refused", "failed"):
            return f"{who}: {self.phase}: {self.note}"
        share = f"{_size(self.done_bytes)} of {_size(self.total_bytes)}"
        if self.phase == "done":
            return f"{who}: holds its model ({share}){f'; {self.note}' if self.note else ''}"
        percent = 100 * self.done_bytes / self.total_bytes if self.total_bytes else 0.0
        left = f", {self.eta_s:.0f} s left" if self.eta_s is not None else ""
        return f"{who}: {percent:.0f}% ({share}), {_size(int(self.rate))}/s{left}"


def _size(count: int) -> str:
    if count >= 1 << 30:
        return f"{count / 2**30:.2f} GiB"
    return f"{count / 2**20:.1f} MiB"


class SupervisorState(BaseModel):
    """What the supervisor is doing now, and what happened before."""

    pid: int
    phase: Phase
    since: float  # unix time of the last phase change
    reason: str = ""  # restarting: what ended the job; failed: why it gave up
    attempt: int = 0  # start attempts since the ranks were last ready
    next_try_at: float | None = None  # restarting: when the next start begins
    restarts: int = 0  # ranks restarted since the supervisor started
    api_restarts: int = 0
    world_size: int | None = None  # ranks of the current (or last) job
    history: list[Failure] = []  # most recent last
    left_out: list[LeftOut] = []
    transfer: list[TransferView] = []  # the last start's model transfer to the workers

    def sending(self) -> str:
        """'' unless the model is on its way to a worker; else how far each one is."""
        if not any(view.phase in ("checking", "sending") for view in self.transfer):
            return ""
        return "sending the model: " + "; ".join(view.line() for view in self.transfer)

    def remember(self, failure: Failure) -> None:
        self.history = [*self.history, failure][-HISTORY:]

    def degraded_note(self) -> str:
        """'' when the whole cluster runs; else who is left out and why."""
        if not self.left_out:
            return ""
        names = ", ".join(f"rank {w.rank} ({w.host}): {w.reason}" for w in self.left_out)
        return f"running without {names} (DEGRADED_MODE=auto)"

    def summary(self, now: float | None = None) -> str:
        """One line for people: the phase, why, and what comes next."""
        now = time.time() if now is None else now
        count = f"{self.restarts} restart{'s' if self.restarts != 1 else ''}"
        last = self.history[-1] if self.history else None
        if self.phase == "running":
            text = f"running, {count} of the ranks, {self.api_restarts} of api.py"
            if last:
                text += f"; last failure {_ago(now - last.at)} ago ({last.what}): {last.reason}"
        elif self.phase == "starting":
            text = f"starting the ranks (attempt {max(self.attempt, 1)})"
            if self.sending():
                text += f", {self.sending()}"
        elif self.phase == "restarting":
            if self.next_try_at is not None and self.next_try_at > now:
                attempt = f"attempt {self.attempt + 1} in {self.next_try_at - now:.0f} s"
            else:
                attempt = f"attempt {self.attempt} under way"
                if self.sending():
                    attempt += f", {self.sending()}"
            text = f"restarting the ranks ({attempt}) after: {self.reason}"
        elif self.phase == "failed":
            text = f"gave up restarting the ranks: {self.reason}; ./launch.sh restart tries again"
        else:
            text = self.phase + (f": {self.reason}" if self.reason else "")
        note = self.degraded_note()
        return f"{text}; {note}" if note else text


def _ago(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def write_state(path: Path, state: SupervisorState) -> None:
    """Replace the file atomically: a reader sees the old or the new state, never half."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}")
    temporary.write_text(state.model_dump_json(indent=1))
    os.replace(temporary, path)


def read_state(path: Path) -> SupervisorState | None:
    """The state, or None when there is no file, it cannot be read, or its pid is gone."""
    try:
        state = SupervisorState.model_validate_json(path.read_bytes())
    except (OSError, ValidationError):
        return None
    return state if pid_alive(state.pid) else None


def print_status(path: Path) -> int:
    """`./launch.sh status`'s supervisor lines; exit 0 only while the ranks run."""
    state = read_state(path)
    if state is None:
        print("supervisor: DOWN (nothing restarts the ranks; ./launch.sh start)")
        return 1
    print(f"supervisor: {state.summary()} (pid {state.pid})")
    for view in state.transfer:
        print(f"    model transfer: {view.line()}")
    for failure in state.history[-3:]:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(failure.at))
        print(f"    {when} {failure.what}: {failure.reason}")
    return 0 if state.phase == "running" else 1


class StateReader:
    """Reads the file again only when it changed (api.py asks on every /health)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._key: tuple[int, int] | None = None
        self._state: SupervisorState | None = None

    def read(self) -> SupervisorState | None:
        key = None
        with contextlib.suppress(OSError):
            stat = self.path.stat()
            key = (stat.st_mtime_ns, stat.st_size)
        if key is None:
            self._key, self._state = None, None
            return None
        if key != self._key:
            self._key, self._state = key, read_state(self.path)
        elif self._state is not None and not pid_alive(self._state.pid):
            self._state = None
        return self._state
