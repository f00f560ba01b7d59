"""Rank 0's burst window (engine/leader.py gather_burst): the requests that follow one to
an idle cluster join it while each comes within the gap of the last, and never past the
window. Real threads and a real queue; the gaps are wide enough for a loaded machine."""

from __future__ import annotations

import queue
import threading
import time

from engine.leader import gather_burst
from ipc.server import Event


def _send_later(events: queue.Queue[Event], delays: list[float]) -> threading.Thread:
    """Put a submit after each delay (seconds after the last one) from another thread."""

    def run() -> None:
        for delay in delays:
            time.sleep(delay)
            events.put(Event("submit"))

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_requests_each_within_the_gap_join_and_a_late_one_waits():
    events: queue.Queue[Event] = queue.Queue()
    handled: list[Event] = []
    sender = _send_later(events, [0.02, 0.02, 0.02, 0.8])
    started = time.monotonic()
    assert gather_burst(events, handled.append, window_s=5.0, gap_s=0.3) == 3
    assert time.monotonic() - started < 0.75  # left at the gap, not at the window
    sender.join()
    assert len(handled) == 3 and events.qsize() == 1  # the late one is for the next step


def test_the_window_bounds_a_steady_stream():
    events: queue.Queue[Event] = queue.Queue()
    sender = _send_later(events, [0.05] * 20)
    started = time.monotonic()
    gathered = gather_burst(events, lambda event: None, window_s=0.3, gap_s=0.5)
    waited = time.monotonic() - started
    sender.join()
    assert 0.3 <= waited < 0.6
    assert 1 <= gathered < 20


def test_no_window_takes_nothing():
    events: queue.Queue[Event] = queue.Queue()
    events.put(Event("submit"))
    assert gather_burst(events, lambda event: None, window_s=0.0) == 0
    assert events.qsize() == 1
