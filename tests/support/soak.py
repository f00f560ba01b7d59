"""Soak: many streaming clients for a while, and the resident memory of the ranks and
api.py sampled once a second (ipc/processes.py: /proc on Linux, ps elsewhere).

Each client sends greedy streaming chats one after another (bench/loadgen.py's
stream_chat, usage requested) until the time is up. Memory: the median of the samples in
the window that follows the warm-up against the median of the last window, per process.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import dataclass, field

import httpx

from bench.loadgen import Endpoint, stream_chat
from bench.stats import RequestResult
from ipc.processes import rss_bytes

WINDOW_S = 10.0  # samples per median


@dataclass
class SoakResult:
    seconds: float  # the soak's length: clients start requests until then
    results: list[RequestResult]
    elapsed: float = 0.0  # until the last request ended
    samples: dict[str, list[tuple[float, int]]] = field(default_factory=dict)  # name: (t, rss)
    warmup_s: float = 0.0

    def memory(self) -> dict[str, tuple[int, int, float]]:
        """name: (RSS after warm-up, RSS at the end, growth as a fraction)."""
        out = {}
        for name, samples in self.samples.items():
            after = [rss for t, rss in samples if self.warmup_s <= t < self.warmup_s + WINDOW_S]
            last = [rss for t, rss in samples if t >= self.seconds - WINDOW_S]
            if after and last:
                start, end = int(statistics.median(after)), int(statistics.median(last))
                out[name] = (start, end, end / start - 1)
        return out

    def describe(self) -> str:
        good = [r for r in self.results if r.ok and r.prompt_tokens > 0]
        tokens = sum(r.completion_tokens for r in good)
        lines = [
            f"{len(self.results)} requests in {self.elapsed:.0f} s, {len(good)} finished with "
            f"usage, {tokens} tokens ({tokens / max(self.elapsed, 1e-9):.0f} tok/s)"
        ]
        for name, (start, end, growth) in self.memory().items():
            lines.append(
                f"  {name}: RSS {start / 2**20:.1f} MiB after warm-up, {end / 2**20:.1f} MiB "
                f"at the end ({growth:+.1%})"
            )
        return "\n".join(lines)


async def soak(
    endpoint: Endpoint,
    clients: int,
    seconds: float,
    max_tokens: int,
    pids: dict[str, int],
    warmup_s: float,
) -> SoakResult:
    """`clients` streaming loops for `seconds`; RSS of `pids` (name: pid) every second."""
    started = time.monotonic()
    deadline = started + seconds
    result = SoakResult(seconds=seconds, results=[], warmup_s=warmup_s)
    result.samples = {name: [] for name in pids}

    async def client(index: int, http: httpx.AsyncClient) -> None:
        count = 0
        while time.monotonic() < deadline:
            prompt = f"[client {index} request {count}] Say anything."
            result.results.append(await stream_chat(http, endpoint, prompt, max_tokens))
            count += 1

    async def sampler() -> None:
        while time.monotonic() < deadline:
            now = time.monotonic() - started
            for name, pid in pids.items():
                rss = rss_bytes(pid)
                if rss is not None:
                    result.samples[name].append((now, rss))
            await asyncio.sleep(1.0)

    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0), limits=limits) as http:
        await asyncio.gather(sampler(), *(client(i, http) for i in range(clients)))
    result.elapsed = time.monotonic() - started
    return result
