"""GET /metrics (Prometheus text) and the metric objects the other routers update."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

from fastapi import APIRouter, Request, Response
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.telemetry import Sample
from ipc.status import PrefixCacheStats, SpeculationStats

router = APIRouter(tags=["metrics"])

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


ValueT = TypeVar("ValueT")

# Figures of rank 0's status: (family, field name, help), counters first.
Figures = tuple[tuple[type[CounterMetricFamily | GaugeMetricFamily], str, str], ...]

# The prefix cache's (PrefixCacheStats), each named "prefix_cache_" + the field.
_PREFIX_CACHE_FAMILIES: Figures = (
    (CounterMetricFamily, "hits", "Requests that reused cached prompt tokens"),
    (CounterMetricFamily, "hit_tokens", "Prompt tokens taken from the prefix cache"),
    (CounterMetricFamily, "misses", "Requests that found no cached prefix"),
    (CounterMetricFamily, "evictions", "Prefix-cache entries evicted"),
    (GaugeMetricFamily, "entries", "Prefix-cache entries held"),
    (GaugeMetricFamily, "cached_tokens", "Tokens held in the prefix cache"),
    (GaugeMetricFamily, "bytes", "Bytes of the prefix cache on rank 0"),
    (GaugeMetricFamily, "budget_tokens", "Tokens the prefix cache may hold (0: off)"),
)
# Its tier on disk (engine/prefix_disk.py), named the same way.
_PREFIX_DISK_FAMILIES: Figures = (
    (CounterMetricFamily, "disk_loads", "Entries read back from disk (PREFIX_CACHE_DIR)"),
    (CounterMetricFamily, "disk_load_failures", "Loads from disk refused by a rank"),
    (GaugeMetricFamily, "disk_entries", "Prefix-cache entries saved on disk"),
    (GaugeMetricFamily, "disk_tokens", "Tokens of the entries saved on disk"),
)


# Speculative decoding's totals (SpeculationStats, leader/speculation.py), each named
# "speculation_" + the field.
_SPECULATION_FAMILIES: Figures = (
    (CounterMetricFamily, "proposed_tokens", "Tokens proposed (prompt lookup and draft)"),
    (CounterMetricFamily, "accepted_tokens", "Proposed tokens the model accepted"),
    (GaugeMetricFamily, "acceptance_rate", "Accepted over proposed tokens since the start"),
    (GaugeMetricFamily, "tokens_per_step", "Tokens a decoding row took per step"),
    (CounterMetricFamily, "draft_proposed_tokens", "Of those, proposed by DRAFT_MODEL"),
    (CounterMetricFamily, "draft_accepted_tokens", "DRAFT_MODEL's proposals accepted"),
)


def figure_families(prefix: str, figures: Figures) -> Callable[[Any], Iterator[Metric]]:
    """The metric families `figures` make of a stats object: `prefix` + the field's name,
    its help, its value."""

    def families(stats: Any) -> Iterator[Metric]:
        for family, name, text in figures:
            yield family(f"{prefix}{name}", text, value=getattr(stats, name))

    return families


def rate_families(sample: Sample) -> Iterator[Metric]:
    """Decode and prefill tokens/s over the last status interval: the figures the
    dashboard plots (gateway/telemetry.py)."""
    yield GaugeMetricFamily(
        "rank_decode_tokens_per_second", "Tokens decoded per second", value=sample.decode_tps
    )
    yield GaugeMetricFamily(
        "rank_prefill_tokens_per_second",
        "Prompt tokens prefilled per second",
        value=sample.prefill_tps,
    )


class ScrapeCollector(Collector, Generic[ValueT]):
    """Metric families made at scrape time from the latest value `read` gives (none while
    it gives None)."""

    def __init__(
        self, read: Callable[[], ValueT | None], families: Callable[[ValueT], Iterator[Metric]]
    ) -> None:
        self.read = read
        self.families = families

    def collect(self) -> Iterator[Metric]:
        value = self.read()
        if value is None:
            return
        yield from self.families(value)


class Metrics:
    """One registry per app, so several apps (tests) never clash."""

    def __init__(
        self,
        prefix_stats: Callable[[], PrefixCacheStats | None] = lambda: None,
        rates: Callable[[], Sample | None] = lambda: None,
        speculation: Callable[[], SpeculationStats | None] = lambda: None,
    ) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        prefix_cache = figure_families(
            "prefix_cache_", _PREFIX_CACHE_FAMILIES + _PREFIX_DISK_FAMILIES
        )
        speculation_totals = figure_families("speculation_", _SPECULATION_FAMILIES)
        r.register(ScrapeCollector(prefix_stats, prefix_cache))
        r.register(ScrapeCollector(speculation, speculation_totals))
        r.register(ScrapeCollector(rates, rate_families))
        self.requests = Counter(
            "api_requests", "HTTP requests by route and status", ["route", "status"], registry=r
        )
        self.tokens = Counter(
            "api_tokens", "Tokens processed, by kind (prompt, completion)", ["kind"], registry=r
        )
        self.ttft = Histogram(
            "api_time_to_first_token_seconds",
            "Seconds from submitting a request to its first text",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.inter_token = Histogram(
            "api_inter_token_seconds",
            "Seconds between successive text deltas of one request",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.batch_size = Gauge(
            "rank_batch_size", "Requests in rank 0's running batch (last status)", registry=r
        )
        self.queued = Gauge("rank_queued_requests", "Requests waiting at rank 0", registry=r)
        self.in_flight = Gauge("api_in_flight_requests", "Generations in progress", registry=r)
        self.ranks_up = Gauge("ranks_up", "1 when rank 0 is connected and ready", registry=r)
        self.errors = Counter(
            "api_errors",
            "Error responses and stream errors, by type and code",
            ["type", "code"],
            registry=r,
        )


@router.get("/metrics", include_in_schema=False)
async def metrics(request: Request) -> Response:
    """Prometheus exposition of the API's counters and the last rank status."""
    state = request.app.state
    status = state.rank_client.status
    state.metrics.ranks_up.set(1 if state.rank_client.availability().state == "ready" else 0)
    if status is not None:
        state.metrics.batch_size.set(status.active_requests)
        state.metrics.queued.set(status.queued_requests)
    return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)
