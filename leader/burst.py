"""Rank 0's burst window: the requests that follow one to an idle cluster join its first
step, so a burst of clients prefills in one forward.

Requests of one burst reach rank 0 a few ms apart, while a step that takes only those
already there prefills them for far longer before the rest can start (docs/BENCHMARKS.md,
"Figures behind the code"). So a request that finds
the cluster idle waits for the next one up to BURST_GAP_S, and for all of them up to
BURST_WINDOW_MS.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable
from typing import Protocol

from ipc.events import Event, Submitted

BURST_GAP_S = 0.005


class Events(Protocol):
    """Where events come from: a queue.Queue, or a test's scripted arrivals on its clock.
    `get` raises queue.Empty when none came within `timeout` seconds."""

    def get(self, block: bool = True, timeout: float | None = None) -> Event: ...


def gather_burst(
    events: Events,
    handle: Callable[[Event], None],
    window_s: float,
    gap_s: float = BURST_GAP_S,
    clock: Callable[[], float] = time.monotonic,
) -> int:
    """Handle the events that follow, each within `gap_s` of the last, for at most
    `window_s` in all (by `clock`); the number of submits among them."""
    deadline = clock() + window_s
    submits = 0
    while (left := deadline - clock()) > 0:
        try:
            event = events.get(timeout=min(gap_s, left))
        except queue.Empty:
            break
        handle(event)
        submits += isinstance(event, Submitted)
    return submits
