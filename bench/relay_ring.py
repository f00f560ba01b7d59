"""A ring all_sum's traffic in plain TCP between namespaced hosts, on the bridge and through
the delayed link (bench/delayed_link.py): what the link itself costs such a collective,
apart from MLX's ring and from the ranks' compute.

    .venv/bin/python -m bench.relay_ring [--ranks 3] [--delay-us 150] [--gbps 10] [--bytes 4096]

Process 0 runs here on the bridge's address, one process on each namespaced worker. A
round is what the ring's all_sum of `--bytes` moves: 2 (R - 1) steps, each a slice of
bytes / 2R sent to both neighbours and one received from each. Prints the median, 10th and
90th percentile round in ms on the bridge and then through the relays, as JSON lines.
Needs root, like the namespaced hosts.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import time

from bench.delayed_link import DelayedLinks
from tests.support.netns_hosts import GATEWAY, NetnsHosts

PORT = 7821
WARM_ROUNDS = 10


def _connect(address: str, port: int) -> socket.socket:
    for _ in range(100):
        try:
            sock = socket.create_connection((address, port), timeout=10)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return sock
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"no connection to {address}:{port}")


def _accept(listener: socket.socket) -> socket.socket:
    sock, _ = listener.accept()
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.settimeout(30)  # a frame lost for good ends the run instead of hanging it
    return sock


def _receive(sock: socket.socket, size: int) -> None:
    got = 0
    while got < size:
        got += len(sock.recv(size - got))


def rank(me: int, addresses: list[str], rounds: int, nbytes: int) -> list[float]:
    """One process of the ring: its rounds' times in ms."""
    count = len(addresses)
    listeners = []
    for port in (PORT, PORT + 1):  # from the left neighbour, from the right
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((addresses[me], port))
        listener.listen(1)
        listener.settimeout(60)
        listeners.append(listener)
    right = _connect(addresses[(me + 1) % count], PORT)
    left = _connect(addresses[(me - 1) % count], PORT + 1)
    from_left, from_right = _accept(listeners[0]), _accept(listeners[1])
    piece = max(1, nbytes // (2 * count))
    data = b"x" * piece
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        for _step in range(2 * (count - 1)):
            right.sendall(data)
            left.sendall(data)
            _receive(from_left, piece)
            _receive(from_right, piece)
        times.append((time.perf_counter() - started) * 1e3)
    return times[WARM_ROUNDS:]


def _summary(times: list[float]) -> dict[str, float]:
    ordered = sorted(times)
    return {
        "median_ms": round(statistics.median(ordered), 3),
        "p10_ms": round(ordered[len(ordered) // 10], 3),
        "p90_ms": round(ordered[9 * len(ordered) // 10], 3),
    }


def ring(hosts: NetnsHosts, addresses: list[str], rounds: int, nbytes: int) -> dict[str, float]:
    """Every worker's process started in its namespace, process 0 here; rank 0's rounds."""
    args = [",".join(addresses), str(rounds), str(nbytes)]
    others = []
    for i, worker in enumerate(hosts.workers):
        assert worker.sshd is not None, f"{worker.netns} has no sshd"  # up() starts them
        others.append(
            subprocess.Popen(
                ["nsenter", "-t", str(worker.sshd.pid), "-n", sys.executable]
                + ["-m", "bench.relay_ring", "--rank", str(i + 1), "--addresses", *args]
            )
        )
    try:
        return _summary(rank(0, addresses, rounds, nbytes))
    finally:
        for process in others:
            process.wait(60)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=3)
    parser.add_argument("--delay-us", type=float, default=150.0)
    parser.add_argument("--gbps", type=float, default=10.0)
    parser.add_argument("--bytes", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=400)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--addresses", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank is not None:  # one worker's process, started by the run below
        addresses, rounds, nbytes = args.addresses
        rank(args.rank, addresses.split(","), int(rounds), int(nbytes))
        return 0

    hosts = NetnsHosts(count=args.ranks - 1).up()
    try:
        addresses = [GATEWAY] + [w.address for w in hosts.workers]
        plain = ring(hosts, addresses, args.rounds, args.bytes)
        print(json.dumps({"link": "bridge", "ranks": args.ranks, **plain}), flush=True)
        with DelayedLinks(hosts, args.delay_us, args.gbps) as links:
            relayed = ring(hosts, addresses, args.rounds, args.bytes)
            print(json.dumps({"link": "relay", **links.report, **relayed}), flush=True)
    finally:
        hosts.down()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
