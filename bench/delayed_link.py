"""A Thunderbolt-like link between namespaced hosts (tests/support/netns_hosts.py): a set
one-way delay (25, 150, 300 us) and a bandwidth cap on a worker's link, carried by
bench/link_relay.c, built here with the system's C compiler.

`with DelayedLinks(hosts, delay_us=150, gbps=10) as links:` every worker's veth leaves the
bridge for a relay: the worker's frames, and rank 0's frames towards it, wait the delay, so
every pair of ranks is one delay apart each way. The relay's own latency (wake-ups, copies)
is measured first with a TCP ping-pong through a relay of no delay against the plain bridge,
and taken off the delay asked for (`own_us`, `set_us`); what a collective then costs is
measured by the ranks at start (distributed/step_probe.py). Everything is undone on exit.
"""

from __future__ import annotations

import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tests.support.netns_hosts import BRIDGE, GATEWAY, PREFIX, NetnsHosts, Worker

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "bench" / "link_relay.c"
BINARY = ROOT / "run" / "bench" / "link_relay"
PING_PORT = 7790
ECHO = (
    "import socket\n"
    "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
    "s.bind(('{address}', {port})); s.listen(1); print('ready', flush=True)\n"
    "c, _ = s.accept(); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)\n"
    "while (b := c.recv(64)): c.sendall(b)\n"
)


def build() -> Path:
    """The relay's binary, built when missing or older than its source."""
    if BINARY.exists() and BINARY.stat().st_mtime >= SOURCE.stat().st_mtime:
        return BINARY
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("the delayed link needs a C compiler (apt-get install gcc)")
    BINARY.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([compiler, "-O2", "-Wall", "-o", str(BINARY), str(SOURCE)], check=True)
    return BINARY


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=20)


class _Relay:
    """One worker's veth moved off the bridge behind a relay process."""

    def __init__(self, worker: Worker, delay_ns: int, bits_per_s: float) -> None:
        self.worker = worker
        self.worker_side = f"{PREFIX}-v{worker.index}"
        self.bridge_side = f"{PREFIX}-d{worker.index}"
        self.relay_side = f"{self.bridge_side}p"
        _ip("link", "add", self.bridge_side, "type", "veth", "peer", "name", self.relay_side)
        _ip("link", "set", self.bridge_side, "master", BRIDGE, "up")
        _ip("link", "set", self.relay_side, "up")
        args = [self.worker_side, self.relay_side, str(delay_ns), str(bits_per_s), GATEWAY]
        self.process = subprocess.Popen(
            [str(build()), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        assert self.process.stdout is not None
        if self.process.stdout.readline().strip() != b"ready":
            self.close()
            raise RuntimeError(f"the link relay did not start: {self.process.stderr}")
        _ip("link", "set", self.worker_side, "nomaster")

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(10)
        assert self.process.stderr is not None
        said = self.process.stderr.read().decode(errors="replace").strip()
        if said and not said.startswith("dropped 0 towards the bridge, 0 towards the worker, 0 "):
            print(f"link relay of {self.worker.address}: {said}", file=sys.stderr)
        subprocess.run(["ip", "link", "del", self.bridge_side], capture_output=True, timeout=20)
        subprocess.run(
            ["ip", "link", "set", self.worker_side, "master", BRIDGE, "up"],
            capture_output=True,
            timeout=20,
        )


def round_trip_us(worker: Worker, trips: int = 300) -> float:
    """Median TCP round trip (64 bytes, TCP_NODELAY) from rank 0's address to `worker`."""
    code = ECHO.format(address=worker.address, port=PING_PORT)
    server = subprocess.Popen(
        ["ip", "netns", "exec", worker.netns, sys.executable, "-c", code],
        stdout=subprocess.PIPE,
    )
    try:
        assert server.stdout is not None
        server.stdout.readline()
        with socket.create_connection((worker.address, PING_PORT), timeout=10) as client:
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            times = []
            for _ in range(trips):
                started = time.perf_counter()
                client.sendall(b"x" * 64)
                got = 0
                while got < 64:
                    got += len(client.recv(64))
                times.append((time.perf_counter() - started) * 1e6)
        return statistics.median(times[trips // 10 :])
    finally:
        server.terminate()
        server.wait(10)


class DelayedLinks:
    """Every worker of `hosts` behind a relay of `delay_us` one way (less the relay's own
    latency) and `gbps` (0: no cap)."""

    def __init__(self, hosts: NetnsHosts, delay_us: float, gbps: float = 0.0) -> None:
        self.hosts, self.delay_us, self.gbps = hosts, delay_us, gbps
        self.relays: list[_Relay] = []
        self.report: dict[str, Any] = {}

    def __enter__(self) -> DelayedLinks:
        worker = self.hosts.workers[0]
        direct = round_trip_us(worker)
        probe = _Relay(worker, 0, 0.0)
        try:
            relayed = round_trip_us(worker)
        finally:
            probe.close()
        own = max(0.0, (relayed - direct) / 2)
        set_us = max(0.0, self.delay_us - own)
        self.report = {
            "asked_us": self.delay_us,
            "gbps": self.gbps,
            "round_trip_direct_us": round(direct, 1),
            "round_trip_relay_us": round(relayed, 1),
            "own_us": round(own, 1),
            "set_us": round(set_us, 1),
        }
        try:
            for each in self.hosts.workers:
                self.relays.append(_Relay(each, int(set_us * 1000), self.gbps * 1e9))
            self.report["round_trip_delayed_us"] = round(round_trip_us(worker), 1)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for relay in self.relays:
            relay.close()
        self.relays = []
