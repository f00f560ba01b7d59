"""hosts.json for mlx.launch, built from the settings (used by launch.sh).

Local mode (WORKER_HOSTS empty): NUM_DEVICES ranks on 127.0.0.1. Remote mode: rank 0 is
this machine, ranks 1.. are WORKER_HOSTS in order (the addresses MLX traffic uses, e.g.
Thunderbolt bridge IPs); WORKER_SSH optionally gives the SSH destination of each worker
(same order), else the worker address is also the SSH destination.

The file is a JSON list that mlx.launch reads: one entry per rank with `ssh` (the SSH
destination; "127.0.0.1" makes mlx.launch run that rank locally without SSH), `ips`,
`rdma` for the jaccl backend, plus our own `weight` (mlx.launch ignores extra keys).

    python -m launcher.hostfile write [--out hosts.json]
    python -m launcher.hostfile workers          # "rank ssh-destination dir" per worker
    python -m launcher.hostfile workers --current  # the same for the running job only
    python -m launcher.hostfile free-port --count N
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import random
import socket
import subprocess
import sys
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from config.settings import PROJECT_DIR, Settings, run_with_settings

LOCAL = "127.0.0.1"
RDMA_FILE = PROJECT_DIR / "rdma.json"


class HostfileError(ValueError):
    """The settings cannot describe a cluster; the message says what to change."""


class HostEntry(BaseModel):
    """One rank of hosts.json, in mlx.launch's format plus its weight."""

    model_config = ConfigDict(extra="forbid")

    ssh: str
    ips: list[str]
    rdma: list[str | list[str] | None] | None = None
    weight: float | None = None


def resolve_ip(host: str) -> str:
    """An IPv4/IPv6 address for `host` (the ring backend needs addresses, not names)."""
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        pass
    try:
        return socket.gethostbyname(host)
    except OSError as exc:
        raise HostfileError(
            f"worker host {host!r} does not resolve ({exc.strerror or exc}); "
            "put its IP address in WORKER_HOSTS"
        ) from None


def local_ip_towards(peer_ip: str) -> str:
    """The address of this machine on the interface that routes to `peer_ip`."""
    family = socket.AF_INET6 if ":" in peer_ip else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((peer_ip, 9))  # UDP connect sends nothing; it only picks a route
        except OSError as exc:
            raise HostfileError(f"no route to worker {peer_ip} ({exc.strerror or exc})") from None
        return probe.getsockname()[0]


def worker_destinations(settings: Settings) -> list[tuple[str, str]]:
    """(address, ssh destination) for each worker, in rank order (ranks 1..)."""
    hosts, ssh = settings.worker_hosts, settings.worker_ssh
    if ssh and len(ssh) != len(hosts):
        raise HostfileError(
            f"WORKER_SSH has {len(ssh)} entries but WORKER_HOSTS has {len(hosts)}: give one "
            "SSH destination per worker host, in the same order, or leave WORKER_SSH empty"
        )
    return list(zip(hosts, ssh or hosts, strict=True))


def _weights(settings: Settings, world: int) -> list[float | None]:
    weights = settings.rank_weights
    if weights is None or weights == "auto":
        return [None if weights == "auto" else 1.0] * world
    if len(weights) != world:
        raise HostfileError(
            f"RANK_WEIGHTS has {len(weights)} numbers but the cluster has {world} ranks: "
            f"give one weight per rank (for example {','.join(['1'] * world)})"
        )
    return list(weights)


def _rdma_matrix(world: int, path: Path = RDMA_FILE) -> list[list]:
    """Per-rank RDMA device lists from the hostfile that mlx.distributed_config wrote."""
    hint = (
        "create it once with `.venv/bin/mlx.distributed_config --backend jaccl "
        f"--over thunderbolt --hosts <this mac>,<workers...> --output {path.name}`"
    )
    if not path.is_file():
        raise HostfileError(f"DISTRIBUTED_BACKEND=jaccl needs {path.name}: {hint}")
    data = json.loads(path.read_text())
    hosts = data["hosts"] if isinstance(data, dict) else data
    matrix = [host.get("rdma") or [] for host in hosts]
    if len(matrix) != world or any(len(row) != world for row in matrix):
        raise HostfileError(f"{path.name} does not describe {world} hosts: {hint}")
    return matrix


def build_hosts(settings: Settings, rdma_file: Path = RDMA_FILE) -> list[HostEntry]:
    """The hosts.json entries, one per rank, for these settings."""
    workers = worker_destinations(settings)
    if not workers:
        world = settings.num_devices
        entries = [HostEntry(ssh=LOCAL, ips=[LOCAL]) for _ in range(world)]
    else:
        ips = [resolve_ip(address) for address, _ in workers]
        entries = [HostEntry(ssh=LOCAL, ips=[local_ip_towards(ips[0])])]
        entries += [
            HostEntry(ssh=dest, ips=[ip]) for ip, (_, dest) in zip(ips, workers, strict=True)
        ]
        world = len(entries)
    if settings.distributed_backend == "jaccl":
        if not workers:
            raise HostfileError("DISTRIBUTED_BACKEND=jaccl needs WORKER_HOSTS (RDMA links)")
        for entry, row in zip(entries, _rdma_matrix(world, rdma_file), strict=True):
            entry.rdma = row
    for entry, weight in zip(entries, _weights(settings, world), strict=True):
        entry.weight = weight
    return entries


def render(entries: list[HostEntry]) -> str:
    """hosts.json text: a list of host objects, without null fields."""
    return json.dumps([entry.model_dump(exclude_none=True) for entry in entries], indent=2) + "\n"


def free_port_run(count: int, start: int = 20000, stop: int = 60000) -> int:
    """The first port of `count` consecutive TCP ports free on 127.0.0.1 and 0.0.0.0."""
    port = start
    while port + count <= stop:
        for offset in range(count):
            if not _port_free(port + offset):
                port += offset + 1
                break
        else:
            return port
    raise HostfileError(f"no {count} consecutive free ports between {start} and {stop}")


def random_free_port_run(count: int) -> int:
    """A random start of `count` consecutive free ports below the ephemeral range.

    For jobs started side by side (tests, benchmarks): a random start keeps two from
    drawing the same ports, and staying under the kernel's ephemeral range keeps an
    outgoing connection's port from taking a rank's port between this check and its
    bind (a CI run lost a cluster to "[ring] Couldn't bind socket (error: 98)").
    """
    stop = ephemeral_start() or 32768  # below every system's default range
    for _ in range(200):
        start = random.randint(20000, stop - count)
        if all(_port_free(port) for port in range(start, start + count)):
            return start
    raise HostfileError(f"no {count} consecutive free ports between 20000 and {stop}")


def ephemeral_start() -> int | None:
    """The first port the kernel hands to outgoing connections: Linux's /proc, macOS's
    sysctl net.inet.ip.portrange.first; None where this system does not say."""
    try:
        if sys.platform == "linux":
            return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
        done = subprocess.run(
            ["sysctl", "-n", "net.inet.ip.portrange.first"], capture_output=True, text=True
        )
        return int(done.stdout.strip())
    except (OSError, ValueError, IndexError):
        return None


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def _left_out() -> set[int]:
    """Ranks (in the full cluster) the supervisor's running job left out."""
    from ipc.supervisor_state import read_state
    from launcher.paths import Paths

    state = read_state(Paths(PROJECT_DIR).state)
    return {worker.rank for worker in state.left_out} if state else set()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launcher.hostfile")
    sub = parser.add_subparsers(dest="command", required=True)
    write = sub.add_parser("write", help="write hosts.json for mlx.launch")
    write.add_argument("--out", type=Path, default=PROJECT_DIR / "hosts.json")
    listing = sub.add_parser("workers", help="print 'rank ssh-destination REMOTE_DIR' per worker")
    listing.add_argument(
        "--current",
        action="store_true",
        help="only the workers of the running job, with their ranks in it (DEGRADED_MODE=auto "
        "may leave some out)",
    )
    port = sub.add_parser("free-port", help="print the first of N consecutive free ports")
    port.add_argument("--count", type=int, default=1)
    args = parser.parse_args(argv)
    if args.command == "free-port":
        try:
            print(free_port_run(max(args.count, 1)))
        except HostfileError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        return 0

    def run(settings: Settings) -> int:
        if args.command == "workers":
            pairs = zip(worker_destinations(settings), settings.remote_dirs, strict=True)
            left_out = _left_out() if args.current else set()
            kept = [
                (dest, d) for rank, ((_, dest), d) in enumerate(pairs, 1) if rank not in left_out
            ]
            for rank, (dest, remote_dir) in enumerate(kept, start=1):
                print(rank, dest, remote_dir)
            return 0
        entries = build_hosts(settings)
        args.out.write_text(render(entries))
        for rank, entry in enumerate(entries):
            weight = "auto" if entry.weight is None else f"{entry.weight:g}"
            print(f"rank {rank}: {entry.ssh} ips={','.join(entry.ips)} weight={weight}")
        return 0

    return run_with_settings(run, HostfileError)


if __name__ == "__main__":
    raise SystemExit(main())
