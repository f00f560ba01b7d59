"""Idle without spinning: a TCP side channel from rank 0 to every other rank.

A rank blocked in a ring all_sum polls its socket and burns a core, so idle workers
block in a plain `recv` on this channel instead. Rank 0 sends one byte to each worker
before the first broadcast after an idle period. End of stream means rank 0 is gone.
"""

from __future__ import annotations

import json
import select
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

from distributed.broadcast import Broadcaster

WAKE_BYTE = b"w"
_RANK = struct.Struct("<I")


class WakeError(Exception):
    """The channel could not be set up or rank 0 went away."""


class WakeSender:
    """Rank 0's end: one connection per worker."""

    def __init__(self, connections: list[socket.socket]) -> None:
        self.connections = connections

    def wake(self) -> None:
        """Wake every worker; they then join the next broadcast."""
        for conn in self.connections:
            conn.sendall(WAKE_BYTE)

    def collect_ready(
        self, on_progress: Callable[[int, int, int], None] | None = None
    ) -> list[dict[str, Any]]:
        """Block (no CPU) until every worker reported ready; their reports in rank order.
        Progress lines a worker sends while loading go to `on_progress(rank, done, total)`."""
        waiting = dict(enumerate(self.connections, start=1))
        buffers = {rank: bytearray() for rank in waiting}
        reports: dict[int, dict[str, Any]] = {}
        while waiting:
            readable, _, _ = select.select(list(waiting.values()), [], [])
            for rank, conn in list(waiting.items()):
                if conn not in readable:
                    continue
                chunk = conn.recv(65536)
                if not chunk:
                    raise WakeError(f"rank {rank} closed the wake channel before it was ready")
                buffers[rank] += chunk
                while b"\n" in buffers[rank]:
                    line, _, rest = bytes(buffers[rank]).partition(b"\n")
                    buffers[rank] = bytearray(rest)
                    message = json.loads(line)
                    if "progress" not in message:
                        reports[rank] = message  # the ready report: nothing follows it
                        del waiting[rank]
                        break
                    if on_progress is not None:
                        on_progress(rank, *message["progress"])
        return [reports[rank] for rank in sorted(reports)]

    def collect_ready_in_background(
        self, on_progress: Callable[[int, int, int], None]
    ) -> Callable[[], list[dict[str, Any]]]:
        """Start collect_ready on a thread (rank 0 loads its own part meanwhile); returns a
        function that waits for the reports (and raises what the thread raised)."""
        outcome: list[list[dict[str, Any]] | BaseException] = []

        def run() -> None:
            try:
                outcome.append(self.collect_ready(on_progress))
            except (WakeError, OSError, ValueError) as exc:
                outcome.append(exc)

        thread = threading.Thread(target=run, name="wake-ready", daemon=True)
        thread.start()

        def wait() -> list[dict[str, Any]]:
            thread.join()
            result = outcome[0]
            if isinstance(result, BaseException):
                raise WakeError(str(result))
            return result

        return wait

    def watch(self, on_lost: Callable[[int], None]) -> None:
        """Call `on_lost(rank)` from a thread when a worker's end closes (it exited).

        Workers send nothing after their ready report, so readable means end of stream;
        the thread blocks in select, using no CPU.
        """

        def run() -> None:
            ranks = {conn.fileno(): rank for rank, conn in enumerate(self.connections, 1)}
            readable, _, _ = select.select(self.connections, [], [])
            on_lost(ranks[readable[0].fileno()])

        threading.Thread(target=run, name="wake-watch", daemon=True).start()

    def close(self) -> None:
        for conn in self.connections:
            conn.close()


class WakeReceiver:
    """A worker's end."""

    def __init__(self, conn: socket.socket) -> None:
        self.conn = conn

    def wait(self) -> None:
        """Block (no CPU) until rank 0 wakes us; WakeError when rank 0 is gone."""
        try:
            data = self.conn.recv(1)
        except OSError as exc:
            raise WakeError(f"wake channel to rank 0 failed: {exc}") from None
        if not data:
            raise WakeError("rank 0 closed the wake channel")

    def send_ready(self, report: dict[str, Any]) -> None:
        """Tell rank 0 this rank has loaded its part (one JSON line)."""
        self.conn.sendall(json.dumps(report).encode() + b"\n")

    def send_progress(self, done: int, total: int) -> None:
        """Tell rank 0 how far this rank's load is (one JSON line; for its status)."""
        self.conn.sendall(json.dumps({"progress": [done, total]}).encode() + b"\n")

    def close(self) -> None:
        self.conn.close()


def _nodelay(conn: socket.socket) -> socket.socket:
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return conn


def open_wake_channel(
    broadcaster: Broadcaster, leader_ip: str, timeout_s: float = 60.0
) -> WakeSender | WakeReceiver | None:
    """Collective: rank 0 listens and broadcasts its port; the others connect.

    Returns None for a group of one.
    """
    group = broadcaster.group
    if group.size() == 1:
        return None
    if group.rank() == 0:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.bind((leader_ip, 0))
        listener.listen(group.size())
        address = f"{leader_ip}:{listener.getsockname()[1]}".encode()
        broadcaster.broadcast(address, "wake channel address broadcast")
        listener.settimeout(timeout_s)
        connections: dict[int, socket.socket] = {}
        try:
            while len(connections) < group.size() - 1:
                conn, _ = listener.accept()
                conn.settimeout(timeout_s)
                header = conn.recv(_RANK.size, socket.MSG_WAITALL)
                conn.settimeout(None)
                (rank,) = _RANK.unpack(header)
                connections[rank] = _nodelay(conn)
        except (TimeoutError, struct.error) as exc:
            raise WakeError(
                f"only {len(connections)} of {group.size() - 1} ranks connected to the "
                f"wake channel on {address.decode()}: {exc}"
            ) from None
        finally:
            listener.close()
        return WakeSender([connections[rank] for rank in sorted(connections)])
    where = broadcaster.broadcast(None, "wake channel address broadcast").decode()
    host, port = where.rsplit(":", 1)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            conn = socket.create_connection((host, int(port)), timeout=5.0)
            break
        except OSError as exc:
            if time.monotonic() > deadline:
                raise WakeError(f"cannot reach rank 0's wake channel at {where}: {exc}") from None
            time.sleep(0.1)
    conn.settimeout(None)
    conn.sendall(_RANK.pack(group.rank()))
    return WakeReceiver(_nodelay(conn))
