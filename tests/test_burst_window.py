"""Rank 0's burst window (leader/burst.py gather_burst): the requests that follow one to an
idle cluster join it while each comes within the gap of the last, and never past the
window. The events arrive on a scripted clock (no sleeping thread, no wall-clock bounds),
and one test checks the real queue's timeout path."""

from __future__ import annotations

import queue

from ipc.events import Cancelled, Event, Submitted
from ipc.protocol import SamplingParams, Submit
from leader.burst import gather_burst


class Arrivals:
    """Events due at set times on a clock of its own: `get` moves the clock to the next
    event's time when it comes within `timeout`, else past the timeout (queue.Empty)."""

    def __init__(self, at: list[float], events: list[Event] | None = None) -> None:
        self.now = 0.0
        self.due = list(zip(at, events or [_submit(i) for i in range(len(at))], strict=True))

    def clock(self) -> float:
        return self.now

    def get(self, block: bool = True, timeout: float | None = None) -> Event:
        assert timeout is not None and timeout > 0, timeout
        if self.due and self.due[0][0] <= self.now + timeout:
            when, event = self.due.pop(0)
            self.now = max(self.now, when)
            return event
        self.now += timeout
        raise queue.Empty


def _submit(index: int) -> Submitted:
    return Submitted(1, Submit(id=f"r{index}", prompt="hi", params=SamplingParams(max_tokens=1)))


def test_requests_each_within_the_gap_join_and_a_late_one_waits():
    arrivals = Arrivals([0.02, 0.04, 0.06, 0.86])
    handled: list[Event] = []
    took = gather_burst(arrivals, handled.append, window_s=5.0, gap_s=0.3, clock=arrivals.clock)
    assert took == 3 and len(handled) == 3
    assert arrivals.now == 0.06 + 0.3  # left at the gap after the third, not at the window
    assert len(arrivals.due) == 1  # the late one is for the next step


def test_the_window_bounds_a_steady_stream():
    arrivals = Arrivals([i / 16 for i in range(1, 21)])  # one every 62.5 ms
    window = 6 / 16
    took = gather_burst(arrivals, lambda event: None, window, gap_s=0.5, clock=arrivals.clock)
    assert took == 6  # those at 1/16 ... 6/16 s; the window ends there
    assert arrivals.now == window and len(arrivals.due) == 14


def test_only_submits_count_but_every_event_is_handled():
    events: list[Event] = [_submit(0), Cancelled(1, "r0"), _submit(1)]
    arrivals = Arrivals([0.001, 0.002, 0.003], events)
    handled: list[Event] = []
    took = gather_burst(arrivals, handled.append, window_s=1.0, gap_s=0.01, clock=arrivals.clock)
    assert took == 2 and handled == events


def test_no_window_takes_nothing():
    events: queue.Queue[Event] = queue.Queue()
    events.put(_submit(0))
    assert gather_burst(events, lambda event: None, window_s=0.0) == 0
    assert events.qsize() == 1


def test_a_real_queue_returns_when_nothing_follows():
    events: queue.Queue[Event] = queue.Queue()
    events.put(_submit(0))
    assert gather_burst(events, lambda event: None, window_s=10.0, gap_s=0.001) == 1
    assert events.empty()
