"""End the rank when a collective hangs longer than COLLECTIVE_TIMEOUT_SECONDS.

The main thread marks each collective with `guard(name)`; a watcher thread sleeps on a
condition variable (no polling) and calls `os._exit` when a guard outlives the deadline,
since a thread blocked inside MLX cannot be interrupted any other way.
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


class CollectiveWatchdog:
    """One per process; `guard` is cheap (a lock and a notify)."""

    def __init__(self, timeout_s: float, exit_code: int = EXIT_COLLECTIVE_TIMEOUT) -> None:
        self.timeout_s = timeout_s
        self.exit_code = exit_code
        self._cond = threading.Condition()
        self._name: str | None = None
        self._started = 0.0
        self._serial = 0
        self._thread = threading.Thread(target=self._watch, name="watchdog", daemon=True)
        self._thread.start()

    @contextmanager
    def guard(self, name: str) -> Iterator[None]:
        """Mark the enclosed block as a collective called `name`."""
        with self._cond:
            self._name = name
            self._started = time.monotonic()
            self._serial += 1
            self._cond.notify()
        try:
            yield
        finally:
            with self._cond:
                self._name = None

    def _watch(self) -> None:
        with self._cond:
            while True:
                while self._name is None:
                    self._cond.wait()
                serial, name = self._serial, self._name
                deadline = self._started + self.timeout_s
                while self._name is not None and self._serial == serial:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        self._expire(name)
                    self._cond.wait(remaining)

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
