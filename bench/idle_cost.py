"""What a running cluster costs in CPU when idle and beside one client, per process.

    .venv/bin/python -m bench.idle_cost                  # the cluster ./launch.sh started here
    .venv/bin/python -m bench.idle_cost --root DIR --idle 30 --long-idle 600

Reads launch.sh's pid files under ROOT/run (mlx.launch and api.py each lead a process
group) and the CPU time of every process in those groups from /proc (Linux), then:

- idle: each process's share of one core over `--idle` seconds with no requests;
- wake-up: time to first token of a streamed request sent after 1 s idle (median of 3),
  and of one sent after `--long-idle` seconds idle (the idle window counts);
- busy: each process's share of a core while one client streams `--max-tokens` tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import httpx
from pydantic import BaseModel

from bench.loadgen import Endpoint, stream_chat
from bench.prompts import essay_prompt
from bench.servers import ROOT, launch_groups, process_cpu
from config.settings import Settings


class CpuShares(BaseModel):
    """Share of one core per process over a window, and their total."""

    seconds: float
    by_process: dict[str, float]

    @property
    def total(self) -> float:
        return sum(self.by_process.values())

    def others_than_ranks(self) -> dict[str, float]:
        return {name: share for name, share in self.by_process.items() if "rank" not in name}


class IdleCost(BaseModel):
    """One measurement of a running cluster."""

    idle: CpuShares
    busy: CpuShares
    ttft_short_idle_s: float  # median of 3 requests, each after 1 s idle
    ttft_long_idle_s: float  # one request after the long idle window
    long_idle_s: float
    busy_tokens: int


def cluster_groups(root: Path) -> list[int]:
    """Process groups that launch.sh started from ROOT; RuntimeError when there are none."""
    groups = launch_groups(root)
    if not groups:
        raise RuntimeError(f"no cluster started by launch.sh in {root} (run/*.pid missing)")
    return groups


class CpuWindow:
    """Start a window at construction; `shares()` ends it."""

    def __init__(self, groups: list[int]) -> None:
        self.groups = groups
        self.started = time.monotonic()
        self.before = {name: seconds for name, (_, seconds) in process_cpu(groups).items()}

    def shares(self) -> CpuShares:
        after = {name: seconds for name, (_, seconds) in process_cpu(self.groups).items()}
        elapsed = time.monotonic() - self.started
        return CpuShares(
            seconds=elapsed,
            by_process={
                name: (seconds - self.before.get(name, 0.0)) / elapsed
                for name, seconds in sorted(after.items())
            },
        )


async def _first_token(client: httpx.AsyncClient, endpoint: Endpoint, tag: str) -> float:
    result = await stream_chat(client, endpoint, essay_prompt(0, tag), max_tokens=4)
    if not result.ok or result.ttft is None:
        raise RuntimeError(f"the wake-up request failed: {result.error}")
    return result.ttft


async def measure(
    endpoint: Endpoint, groups: list[int], idle_s: float, long_idle_s: float, busy_tokens: int
) -> IdleCost:
    """A warm-up request, three after 1 s idle each, the idle window (and the rest of the
    long idle), one request after it, then one client's generation with its CPU window."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=10.0)) as client:
        await _first_token(client, endpoint, f"warm-up-{time.time()}")  # first-use costs
        short = []
        for index in range(3):
            await asyncio.sleep(1.0)
            short.append(await _first_token(client, endpoint, f"short-idle-{index}-{time.time()}"))
        window = CpuWindow(groups)
        await asyncio.sleep(idle_s)
        idle = window.shares()
        await asyncio.sleep(max(0.0, long_idle_s - idle_s))
        long_ttft = await _first_token(client, endpoint, f"long-idle-{time.time()}")
        window = CpuWindow(groups)
        result = await stream_chat(client, endpoint, essay_prompt(1, str(time.time())), busy_tokens)
        busy = window.shares()
    if not result.ok:
        raise RuntimeError(f"the busy request failed: {result.error}")
    return IdleCost(
        idle=idle,
        busy=busy,
        ttft_short_idle_s=statistics.median(short),
        ttft_long_idle_s=long_ttft,
        long_idle_s=max(idle_s, long_idle_s),
        busy_tokens=result.completion_tokens,
    )


def report(cost: IdleCost) -> str:
    """A few lines for people."""

    def shares(window: CpuShares) -> str:
        return ", ".join(f"{name} {share:.1%}" for name, share in window.by_process.items())

    return "\n".join(
        [
            f"idle {cost.idle.seconds:.0f} s: total {cost.idle.total:.2%} of a core "
            f"({shares(cost.idle)})",
            f"busy, 1 client x {cost.busy_tokens} tokens: {shares(cost.busy)}",
            f"time to first token after 1 s idle {cost.ttft_short_idle_s * 1000:.0f} ms, "
            f"after {cost.long_idle_s:.0f} s idle {cost.ttft_long_idle_s * 1000:.0f} ms "
            f"({cost.ttft_long_idle_s / cost.ttft_short_idle_s:.2f}x)",
        ]
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=ROOT, help="project dir launch.sh ran in")
    parser.add_argument("--url", default="", help="API base URL (default: API_PORT of ROOT)")
    parser.add_argument("--idle", type=float, default=30.0, help="idle window, seconds")
    parser.add_argument("--long-idle", type=float, default=0.0, help="idle before the wake-up")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens of the busy request")
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    args = parser.parse_args(argv)
    url = args.url or _api_url(args.root)
    try:
        cost = asyncio.run(
            measure(
                Endpoint(url), cluster_groups(args.root), args.idle, args.long_idle, args.max_tokens
            )
        )
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(cost.model_dump_json(indent=2) if args.json else report(cost))
    return 0


def _api_url(root: Path) -> str:
    """The API address that ROOT's .env (and this environment) configure."""
    settings = Settings(_env_file=root / ".env")
    return f"http://{settings.api_host}:{settings.api_port}"


if __name__ == "__main__":
    sys.exit(main())
