"""Added latency on one namespaced worker's link (tests/support/netns_hosts.py).

`tc qdisc add dev eth0 root netem delay 100ms` inside the worker's namespace where the
kernel has sch_netem. Where it does not (CONFIG_NET_SCH_NETEM unset, as on the
development VM), a delay line in user space does the same job: the worker's veth is taken
off the bridge, a second veth pair joins the bridge in its place, and a relay process
moves every frame between the two with AF_PACKET sockets, holding the worker's outgoing
frames for the delay. The sockets use PACKET_VNET_HDR, so segmentation offload and
checksum state pass through unchanged. Everything is undone on exit.

    python -m tests.support.delay_link WORKER_SIDE BRIDGE_SIDE DELAY_S   # the relay
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import selectors
import socket
import subprocess
import sys
import time
from pathlib import Path

from tests.support.netns_hosts import BRIDGE, PREFIX, NetnsHosts, Worker

ETH_P_ALL = 0x0003
SOL_PACKET = 263
PACKET_VNET_HDR = 15
PACKET_OUTGOING = 4
FRAME_BYTES = 65536 + 16  # a GSO super-frame and its virtio header


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=20)


class DelayedLink:
    """`with DelayedLink(hosts, worker, 0.1) as link:` the worker's egress waits 0.1 s."""

    def __init__(self, hosts: NetnsHosts, worker: Worker, delay_s: float) -> None:
        self.hosts, self.worker, self.delay_s = hosts, worker, delay_s
        self.kind = ""
        self._relay: subprocess.Popen[bytes] | None = None
        self._worker_side = f"{PREFIX}-v{worker.index}"
        self._bridge_side = f"{PREFIX}-d{worker.index}"

    def __enter__(self) -> DelayedLink:
        netem = subprocess.run(
            ["ip", "netns", "exec", self.worker.netns, "tc", "qdisc", "add", "dev", "eth0"]
            + ["root", "netem", "delay", f"{self.delay_s * 1000:.0f}ms"],
            capture_output=True,
            text=True,
            timeout=20,
        )
        if netem.returncode == 0:
            self.kind = "tc netem"
            return self
        self.kind = f"user-space delay line (tc netem: {netem.stderr.strip()})"
        _ip("link", "add", self._bridge_side, "type", "veth", "peer", "name", self._relay_side)
        _ip("link", "set", self._bridge_side, "master", BRIDGE, "up")
        _ip("link", "set", self._relay_side, "up")
        root = Path(__file__).resolve().parents[2]
        self._relay = subprocess.Popen(
            [sys.executable, "-m", "tests.support.delay_link"]
            + [self._worker_side, self._relay_side, str(self.delay_s)],
            cwd=root,
            stdout=subprocess.PIPE,
        )
        # The worker leaves the bridge only once the relay moves its frames: taken off first,
        # its link was down while the relay's Python started (seconds on 2 busy cores), TCP
        # backed off past COLLECTIVE_TIMEOUT_SECONDS and a CI run's ranks stopped.
        assert self._relay.stdout is not None
        ready = selectors.DefaultSelector()
        ready.register(self._relay.stdout, selectors.EVENT_READ)
        if not ready.select(60) or self._relay.stdout.readline().strip() != b"ready":
            self.__exit__()
            raise RuntimeError("the delay line's relay did not start within 60 s")
        _ip("link", "set", self._worker_side, "nomaster")
        return self

    @property
    def _relay_side(self) -> str:
        return f"{self._bridge_side}p"

    def __exit__(self, *exc: object) -> None:
        if self.kind == "tc netem":
            subprocess.run(
                ["ip", "netns", "exec", self.worker.netns, "tc", "qdisc", "del", "dev", "eth0"]
                + ["root"],
                capture_output=True,
                timeout=20,
            )
            return
        if self._relay is not None:
            self._relay.terminate()
            self._relay.wait(10)
        subprocess.run(["ip", "link", "del", self._bridge_side], capture_output=True, timeout=20)
        _ip("link", "set", self._worker_side, "master", BRIDGE, "up")


def _packet_socket(interface: str) -> socket.socket:
    sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
    sock.setsockopt(SOL_PACKET, PACKET_VNET_HDR, 1)
    sock.bind((interface, ETH_P_ALL))
    sock.setblocking(False)
    return sock


def relay(worker_side: str, bridge_side: str, delay_s: float) -> None:
    """Move frames both ways; those from the worker leave `delay_s` later, in order."""
    sockets = {"worker": _packet_socket(worker_side), "bridge": _packet_socket(bridge_side)}
    selector = selectors.DefaultSelector()
    for name, sock in sockets.items():
        selector.register(sock, selectors.EVENT_READ, name)
    pending: list[tuple[float, int, bytes]] = []  # (due, order, frame) towards the bridge
    order = itertools.count()
    print("ready", flush=True)
    while True:  # until SIGTERM ends the process
        timeout = max(0.0, pending[0][0] - time.monotonic()) if pending else None
        for key, _ in selector.select(timeout):
            sock = sockets[key.data]
            while True:
                try:
                    frame, address = sock.recvfrom(FRAME_BYTES)
                except BlockingIOError:
                    break
                if address[2] == PACKET_OUTGOING:
                    continue  # what we sent on this interface ourselves
                if key.data == "worker":
                    heapq.heappush(pending, (time.monotonic() + delay_s, next(order), frame))
                else:
                    _send(sockets["worker"], frame)
        now = time.monotonic()
        while pending and pending[0][0] <= now:
            _send(sockets["bridge"], heapq.heappop(pending)[2])


def _send(sock: socket.socket, frame: bytes) -> None:
    # a full queue or a link going down drops the frame, as a wire would
    with contextlib.suppress(OSError):
        sock.send(frame)


if __name__ == "__main__":
    relay(sys.argv[1], sys.argv[2], float(sys.argv[3]))
