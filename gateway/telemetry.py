"""What the dashboard and /metrics show, kept by api.py from what it already receives.

Every status rank 0 answers (the API asks once a second anyway) adds one sample: decode
and prefill tokens/s from the difference of rank 0's counters, the queue and the batch.
Every finished request adds a line to the recent requests. Reading it never asks the
ranks anything, so an idle dashboard tab costs them nothing.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from pydantic import BaseModel

from ipc.protocol import Done
from ipc.status import Status

HISTORY_SECONDS = 600.0
RECENT_REQUESTS = 30


class Sample(BaseModel):
    """One point of the live plots."""

    t: float  # seconds since the epoch
    decode_tps: float
    prefill_tps: float
    queued: int
    active: int


class RecentRequest(BaseModel):
    id: str
    finished_at: float  # seconds since the epoch
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    ttft_s: float
    tokens_per_second: float
    finish_reason: str


@dataclass
class _Last:
    at: float
    decode: int
    prefill: int
    steps: int


class Telemetry:
    """Samples of rank 0's status and the recent requests, for the last ten minutes."""

    def __init__(self) -> None:
        self.samples: deque[Sample] = deque()
        self.recent: deque[RecentRequest] = deque(maxlen=RECENT_REQUESTS)
        self._last: _Last | None = None

    def observe(self, status: Status) -> None:
        """A status rank 0 just answered."""
        now = time.time()
        counters = status.counters
        last = self._last
        if last is not None and counters.steps < last.steps:
            last = None  # the ranks restarted: their counters began again
        if last is not None and now > last.at:
            seconds = now - last.at
            self.samples.append(
                Sample(
                    t=now,
                    decode_tps=(counters.decode_tokens - last.decode) / seconds,
                    prefill_tps=(counters.prefill_tokens - last.prefill) / seconds,
                    queued=status.queued_requests,
                    active=status.active_requests,
                )
            )
        self._last = _Last(now, counters.decode_tokens, counters.prefill_tokens, counters.steps)
        while self.samples and self.samples[0].t < now - HISTORY_SECONDS:
            self.samples.popleft()

    def finished(self, done: Done) -> None:
        """A request rank 0 completed."""
        self.recent.appendleft(
            RecentRequest(
                id=done.id,
                finished_at=time.time(),
                prompt_tokens=done.usage.prompt_tokens,
                cached_tokens=done.usage.prompt_tokens_details.cached_tokens,
                completion_tokens=done.usage.completion_tokens,
                ttft_s=round(done.timings.time_to_first_token_s, 4),
                tokens_per_second=round(done.timings.generation_tokens_per_second, 2),
                finish_reason=done.finish_reason,
            )
        )

    def rates(self) -> Sample | None:
        """The latest sample."""
        return self.samples[-1] if self.samples else None
