"""What a load generator measures: each streaming request's record (time to first token,
inter-token latency, decode rate) and a workload's summary over its requests (medians,
p90s, aggregate throughput), as JSON and as a plain-text table."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel


@dataclass
class TokenCounts:
    """A request's token counts as the server reports them in its `usage`."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens the server reports as reused from its cache

    def take_usage(self, usage: dict[str, Any]) -> None:
        """Read an OpenAI `usage` object (a stream's last chunk carries it)."""
        self.prompt_tokens = usage.get("prompt_tokens", 0)
        self.completion_tokens = usage.get("completion_tokens", 0)
        self.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0


@dataclass
class RequestResult(TokenCounts):
    """What one streaming request saw; times in seconds from its send."""

    ok: bool = False
    error: str = ""
    start: float = 0.0  # time.perf_counter() at send
    end: float = 0.0  # seconds after start when the stream ended
    chunk_times: list[float] = field(default_factory=list)  # content deltas
    text: str = ""  # the answer

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] if self.chunk_times else None

    @property
    def decode_seconds(self) -> float | None:
        """From the first to the last content delta; None when fewer than 2 tokens."""
        if self.completion_tokens < 2 or len(self.chunk_times) < 2:
            return None
        return self.chunk_times[-1] - self.chunk_times[0]

    @property
    def itl(self) -> float | None:
        """Mean seconds between tokens after the first."""
        seconds = self.decode_seconds
        return None if not seconds else seconds / (self.completion_tokens - 1)

    @property
    def decode_tps(self) -> float | None:
        seconds = self.decode_seconds
        return None if not seconds else (self.completion_tokens - 1) / seconds


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation between closest ranks
    (numpy's default method); None for no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q={q} must be within 0..100")
    ordered = sorted(values)
    if not ordered:
        return None
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


class Stat(BaseModel):
    """Median and 90th percentile of one figure over the requests that have it."""

    median: float | None
    p90: float | None
    count: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Stat:
        return cls(median=percentile(values, 50), p90=percentile(values, 90), count=len(values))


class Summary(BaseModel):
    """One workload's figures (JSON-ready)."""

    label: str
    concurrency: int
    requests: int
    errors: int
    error_samples: list[str]
    prompt_tokens_median: float | None
    completion_tokens_total: int
    completion_tokens_median: float | None
    wall_seconds: float
    throughput_tok_s: float | None  # completion tokens of all requests / wall time
    ttft_s: Stat
    itl_ms: Stat
    decode_tok_s: Stat
    server_cpu: dict[str, float] = {}  # % of one core by process role, filled by callers
    load_average: float | None = None  # the machine's 1-minute load average at the start


def summarize(label: str, concurrency: int, results: Sequence[RequestResult]) -> Summary:
    """Aggregate per-request results; failed requests count as errors only."""
    good = [r for r in results if r.ok]
    wall = 0.0
    if results:
        wall = max(r.start + r.end for r in results) - min(r.start for r in results)
    total = sum(r.completion_tokens for r in good)
    return Summary(
        label=label,
        concurrency=concurrency,
        requests=len(results),
        errors=len(results) - len(good),
        error_samples=sorted({r.error for r in results if not r.ok})[:3],
        prompt_tokens_median=percentile([r.prompt_tokens for r in good], 50),
        completion_tokens_total=total,
        completion_tokens_median=percentile([r.completion_tokens for r in good], 50),
        wall_seconds=round(wall, 4),
        throughput_tok_s=total / wall if good and wall > 0 else None,
        ttft_s=Stat.of([r.ttft for r in good if r.ttft is not None]),
        itl_ms=Stat.of([r.itl * 1000 for r in good if r.itl is not None]),
        decode_tok_s=Stat.of([r.decode_tps for r in good if r.decode_tps is not None]),
    )


def _fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def table(summaries: Sequence[Summary]) -> str:
    """A plain-text table of summaries (one row each)."""
    header = (
        f"{'workload':<22}{'C':>3}{'ok':>5}{'tok':>6}{'agg tok/s':>11}{'ttft s':>9}"
        f"{'p90':>8}{'itl ms':>9}{'p90':>8}{'dec tok/s':>11}{'p90':>8}"
    )
    rows = [header, "-" * len(header)]
    for s in summaries:
        ok = f"{s.requests - s.errors}/{s.requests}"
        rows.append(
            f"{s.label:<22}{s.concurrency:>3}{ok:>5}{s.completion_tokens_total:>6}"
            f"{_fmt(s.throughput_tok_s, 1):>11}{_fmt(s.ttft_s.median, 3):>9}"
            f"{_fmt(s.ttft_s.p90, 3):>8}{_fmt(s.itl_ms.median, 1):>9}{_fmt(s.itl_ms.p90, 1):>8}"
            f"{_fmt(s.decode_tok_s.median, 1):>11}{_fmt(s.decode_tok_s.p90, 1):>8}"
        )
    for s in summaries:
        for sample in s.error_samples:
            rows.append(f"error in {s.label}: {sample}")
    return "\n".join(rows)
