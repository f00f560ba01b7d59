"""Before each remote start, every worker of the job gets its part of the model from this
host: the supervisor runs one sender per worker (launcher/model_sender.py), all at once, and
turns their JSON lines into the start's progress, supervisor.log lines and the state that
`./launch.sh status`, /cluster/status and the dashboard show.

The senders plan the split as the ranks will, so they need each rank's machine as that rank
describes itself (host name, cores, memory: distributed/hosts.py): this host's from
`launcher.detect`'s facts script, each worker's over SSH. The job's ranks then learn the
model's key (MLX_RING_RECEIVED_MODEL) and load what arrived; rank 0 never waits for a
worker that already holds its share (its check costs one SSH session and a read of the
share's blocks on the worker).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from acquisition.identity import identify
from acquisition.received import RECEIVED_ENV
from config.settings import Settings
from ipc.supervisor_state import TransferView
from launcher import remote
from launcher.hostfile import HostfileError, resolve_ip

log = logging.getLogger("ring.supervisor")

REPORT_EVERY_S = 5.0  # a progress line in the start's output and the log this often


@dataclass
class Sender:
    """One worker's sender process and what it said last."""

    worker: remote.Worker
    rank: int  # in the job (a job without a left-out worker renumbers)
    process: subprocess.Popen[str]
    view: TransferView
    final: dict[str, Any] = field(default_factory=dict)
    reported_at: float = 0.0
    lines: list[str] = field(default_factory=list)  # new lines for the start's output

    def read(self, lock: threading.Lock) -> None:
        assert self.process.stdout is not None
        for text in self.process.stdout:
            try:
                event = json.loads(text)
            except ValueError:
                continue
            with lock:
                self._take(event)

    def _take(self, event: dict[str, Any]) -> None:
        kind = event.get("event")
        view = self.view
        view.total_bytes = int(event.get("share_bytes", view.total_bytes))
        if kind == "offer":
            view.share = str(event.get("share", ""))
            self.lines.append(f"rank {self.rank} ({view.host}) receives: {view.share}")
        elif kind == "inventory":
            view.done_bytes = int(event.get("have_bytes", 0))
            self.lines.append(_inventory_line(self.rank, view.host, event))
        elif kind == "progress":
            view.phase = "sending"
            view.done_bytes = int(event["done_bytes"])
            view.rate = float(event["rate"])
            view.eta_s = event.get("eta_s")
        elif kind in ("done", "refused", "failed"):
            self.final = event
            view.phase = kind
            view.note = str(event.get("reason", "")) if kind != "done" else _done_note(event)
            if kind == "done":
                view.done_bytes = view.total_bytes


def _inventory_line(rank: int, host: str, event: dict[str, Any]) -> str:
    who = f"rank {rank} ({host})"
    if event.get("have") == "full":
        return f"{who} holds a full copy of the model ({event['directory']}): nothing to send"
    damaged = (
        f", {len(event['damaged'])} damaged block(s) to send again" if event["damaged"] else ""
    )
    return (
        f"{who} holds {_size(event['have_bytes'])} of its share (checked in "
        f"{event['verified_s']:.1f} s{damaged}), needs {_size(event['need_bytes'])}, "
        f"{_size(event['free_bytes'])} free in {event['directory']}"
    )


def _done_note(event: dict[str, Any]) -> str:
    if not event.get("sent_bytes"):
        return "nothing to send"
    seconds = float(event.get("seconds") or 0.0)
    rate = event["sent_bytes"] / seconds if seconds else 0.0
    return f"sent {_size(event['sent_bytes'])} in {seconds:.1f} s ({_size(int(rate))}/s)"


def _size(count: int) -> str:
    if count >= 1 << 30:
        return f"{count / 2**30:.2f} GiB"
    return f"{count / 2**20:.1f} MiB"


def job_hosts(active: list[remote.Worker]) -> list[dict[str, Any]]:
    """Every rank's machine as its rank will describe itself (this host first); raises
    ConnectionError or ValueError when a worker cannot say."""
    from launcher.detect import HostFacts, local_facts, remote_facts

    def facts(worker: remote.Worker | None) -> HostFacts:
        if worker is None:
            return local_facts()
        return remote_facts(worker.dest, worker.remote_dir, remote.SSH_TIMEOUT_S)

    with ThreadPoolExecutor(max_workers=len(active) + 1) as pool:
        found = list(pool.map(facts, [None, *active]))
    return [
        {
            "host": f.hostname,
            "cores": f.cores or 1,
            "memory_bytes": f.rank_memory_bytes or f.total_bytes or 0,
        }
        for f in found
    ]


class Transfers:
    """The senders of one start, one per worker of the job."""

    def __init__(self, settings: Settings, environ: dict[str, str], model_dir: Path) -> None:
        self.settings = settings
        self.environ = environ
        self.model_dir = model_dir
        self.senders: list[Sender] = []
        self.lock = threading.Lock()

    def model_key(self) -> str:
        return identify(self.model_dir, self.settings.model_cache_dir).key

    def start(self, active: list[remote.Worker], hosts: list[dict[str, Any]]) -> None:
        for rank, worker in enumerate(active, start=1):
            argv = [
                sys.executable,
                "-m",
                "launcher.model_sender",
                "--model-dir",
                str(self.model_dir),
                "--rank",
                str(rank),
                "--hosts",
                json.dumps(hosts),
                "--dest",
                worker.dest,
                "--remote-dir",
                worker.remote_dir,
                "--address",
                resolve_ip(worker.address),
                "--streams",
                str(self.settings.transfer_streams),
            ]
            process = subprocess.Popen(
                argv,
                cwd=Path(__file__).resolve().parent.parent,
                env=self.environ,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,  # stop ends its SSH session with it
            )
            view = TransferView(rank=rank, host=worker.dest, phase="checking")
            sender = Sender(worker, rank, process, view)
            threading.Thread(target=sender.read, args=(self.lock,), daemon=True).start()
            self.senders.append(sender)

    def running(self) -> bool:
        return any(s.process.poll() is None for s in self.senders)

    def views(self) -> list[TransferView]:
        with self.lock:
            return [s.view.model_copy() for s in self.senders]

    def news(self, now: float) -> list[str]:
        """Lines for the start's output and the log: what the senders said, and each
        sending worker's progress every REPORT_EVERY_S."""
        out = []
        with self.lock:
            for sender in self.senders:
                out += sender.lines
                sender.lines = []
                if sender.view.phase == "sending" and now - sender.reported_at >= REPORT_EVERY_S:
                    sender.reported_at = now
                    out.append(sender.view.line())
        return out

    def outcome(self) -> str | None:
        """None when every worker holds its part; else why not (first the refusals)."""
        for sender in self.senders:
            sender.process.wait()
        for kind in ("refused", "failed"):
            for s in self.senders:
                if s.view.phase == kind:
                    return (
                        f"model transfer to rank {s.rank} ({s.worker.dest}) {kind}: {s.view.note}"
                    )
        for s in self.senders:
            if s.view.phase != "done":
                err = (s.process.stderr.read() if s.process.stderr else "").strip().splitlines()
                why = err[-1] if err else f"exit status {s.process.returncode}"
                return f"the model sender for rank {s.rank} ({s.worker.dest}) ended: {why}"
        return None

    def stop(self) -> None:
        """End every sender and its SSH session (what arrived stays for the next start)."""
        for sender in self.senders:
            if sender.process.poll() is None:
                try:
                    os.killpg(sender.process.pid, signal.SIGTERM)
                except (ProcessLookupError, PermissionError):
                    continue
        deadline = time.monotonic() + 5
        for sender in self.senders:
            try:
                sender.process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(sender.process.pid, signal.SIGKILL)
                sender.process.wait()


def send_model(
    settings: Settings,
    environ: dict[str, str],
    model_dir: Path | None,
    active: list[remote.Worker],
    wait: Callable[[float], object],
    stopped: Callable[[], bool],
    say: Callable[[str], None],
    publish: Callable[[list[TransferView]], None],
) -> tuple[str | None, dict[str, str]]:
    """Bring every worker of the job its part of the model (see the module docs).

    `wait(s)` blocks up to s seconds (the supervisor's own loop: signals, api.py);
    `say` reports a line (the start's output and the log); `publish` the workers' state.
    Returns why a worker does not hold its part (None when they all do; also when
    `stopped()`), and the job's environment with the model's key for the ranks."""
    if not active or model_dir is None:
        return None, environ
    transfers = Transfers(settings, environ, model_dir)
    try:
        hosts = job_hosts(active)
        key = transfers.model_key()
        transfers.start(active, hosts)
    except (ConnectionError, ValueError, OSError, HostfileError) as exc:
        return f"could not start the model transfer: {exc}", environ
    say("==> Model: each worker receives its part from this host (launcher/model_sender.py)")
    try:
        while transfers.running() and not stopped():
            wait(0.5)
            for line in transfers.news(time.monotonic()):
                say(f"    {line}")
            publish(transfers.views())
    finally:
        if stopped():
            transfers.stop()
    if stopped():
        return None, environ
    reason = transfers.outcome()
    for line in transfers.news(float("inf")):
        say(f"    {line}")
    views = transfers.views()
    publish(views)
    for view in views:
        if view.phase == "done":
            say(f"    {view.line()}")
    return reason, environ | {RECEIVED_ENV: key}
