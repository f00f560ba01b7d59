"""End the rank when a collective hangs longer than COLLECTIVE_TIMEOUT_SECONDS.

The main thread marks each collective with `guard(name)`; a watcher thread looks a few
times a second and calls `os._exit` when a guard has outlived the deadline, since a thread
blocked inside MLX cannot be interrupted any other way.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager

import mlx.core as mx

from distributed.exits import EXIT_COLLECTIVE_TIMEOUT

# A watchdog's `guard`, as parts of a model that evaluate inside the forward pass take it.
EvalGuard = Callable[[str], AbstractContextManager[object]]
log = logging.getLogger("ring.watchdog")
WATCH_PERIOD_S = 0.5  # how often the watcher looks (at most a tenth of the timeout)


class CollectiveWatchdog:
    """One per process. `guard` is two attribute writes and wakes nobody: an expert split
    guards every MoE layer's routing, and with a guard that notified the watcher (a lock
    and a notify, 26 us alone) the woken watcher took the GIL in turns with the main
    thread while both cores were busy (py-spy, the 2-rank split at 1 client: 18% of rank
    0's samples in `Condition.notify`). The watcher looks every `period_s` instead, so a
    hang is caught at most that much after the deadline."""

    def __init__(self, timeout_s: float, exit_code: int = EXIT_COLLECTIVE_TIMEOUT) -> None:
        self.timeout_s = timeout_s
        self.exit_code = exit_code
        self.period_s = min(WATCH_PERIOD_S, timeout_s / 10)
        self._name: str | None = None
        self._started = 0.0
        self._thread = threading.Thread(target=self._watch, name="watchdog", daemon=True)
        self._thread.start()

    @contextmanager
    def guard(self, name: str) -> Iterator[None]:
        """Mark the enclosed block as a collective called `name`."""
        self._started = time.monotonic()  # before the name: the watcher reads it after
        self._name = name
        try:
            yield
        finally:
            self._name = None

    def _watch(self) -> None:
        while True:
            time.sleep(self.period_s)
            name = self._name
            # read after the name, so never older than the guard that set it
            if name is not None and time.monotonic() - self._started > self.timeout_s:
                self._expire(name)

    def _expire(self, name: str) -> None:
        log.error(
            "collective '%s' did not finish within COLLECTIVE_TIMEOUT_SECONDS=%.1f s "
            "(a peer rank is stuck or gone); exiting with status %d",
            name,
            self.timeout_s,
            self.exit_code,
        )
        for handler in logging.getLogger().handlers:
            handler.flush()
        os._exit(self.exit_code)


def guarded_eval(array: mx.array, guard: EvalGuard | None, what: str) -> None:
    """Evaluate `array`, inside `guard(what)` when a watchdog gave one."""
    if guard is None:
        mx.eval(array)
    else:
        with guard(what):
            mx.eval(array)
