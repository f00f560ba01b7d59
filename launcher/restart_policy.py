"""When the supervisor starts something again, and when it stops trying.

Backoff: 1 s after the first failure, doubling up to 60 s, back to 1 s once the thing
came up (the ranks were ready again, api.py ran a while). Crash loop: `limit` failures
within `window_s` seconds, and the supervisor gives up. A wait that is not a failure of
ours (a worker that does not answer over SSH) backs off the same way but never counts
towards the crash loop: a Mac asleep for an hour must not make the cluster give up.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

FIRST_DELAY_S = 1.0
MAX_DELAY_S = 60.0


@dataclass(frozen=True)
class Ended:
    """Why a job ended (or could not start)."""

    reason: str
    counts: bool = True  # False: a worker did not answer (a wait, never a crash)
    before_ready: bool = False
    start_goes_on: bool = False  # True: a first start tried again, `start` keeps waiting


class RestartPolicy:
    """Backoff between attempts and the crash-loop limit, for one thing being restarted."""

    def __init__(
        self,
        limit: int,
        window_s: float,
        first_s: float = FIRST_DELAY_S,
        max_s: float = MAX_DELAY_S,
    ) -> None:
        self.limit = limit
        self.window_s = window_s
        self.first_s = first_s
        self.max_s = max_s
        self._failures: deque[float] = deque()
        self._consecutive = 0  # failures and waits since it last came up

    def failed(self, now: float) -> None:
        """It ended or did not come up: counts towards the crash loop."""
        self._failures.append(now)
        self._consecutive += 1

    def waited(self) -> None:
        """It could not be tried (a worker did not answer): backs off, never counts."""
        self._consecutive += 1

    def came_up(self) -> None:
        self._consecutive = 0

    def recent_failures(self, now: float) -> int:
        while self._failures and self._failures[0] <= now - self.window_s:
            self._failures.popleft()
        return len(self._failures)

    def gave_up(self, now: float) -> bool:
        return self.recent_failures(now) >= self.limit

    def delay(self) -> float:
        """Seconds to wait before the next attempt."""
        if self._consecutive == 0:
            return 0.0
        return min(self.max_s, self.first_s * 2 ** (self._consecutive - 1))
