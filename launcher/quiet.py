"""Stop mlx.launch's relay busy loop: one byte on its stdin once the ranks run, then a check.

mlx.launch's relay threads select() on each rank's stdin pipe, which is always writable,
so it spins (a core or more) while the ranks idle. The ranks close their stdin at start;
once one byte reaches mlx.launch's stdin, its write to each closed pipe fails and it stops
watching them. Its own stdin must stay open without EOF (/dev/null is worse: EOF is always
readable), so the supervisor gives it the reading end of a pipe whose writing end it
keeps. A rank that had not closed its stdin yet keeps its pipe watched, so a second byte
follows while mlx.launch still spins. CPU time comes from ipc/processes.py (/proc on
Linux, ps on macOS).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from ipc.processes import cpu_seconds

SPINNING = 20  # % of one core above which mlx.launch is still busy-looping


Wait = Callable[[float], None]


def cpu_percent(pid: int, seconds: float, wait: Wait = time.sleep) -> int | None:
    """Whole-process CPU over about `seconds` (`wait` may return sooner) as % of one core;
    None where the process is gone (or where the system cannot tell: the supervisor goes
    on without this check)."""
    try:
        start, before = time.monotonic(), cpu_seconds(pid)
        wait(seconds)
        after, elapsed = cpu_seconds(pid), time.monotonic() - start
    except OSError:
        return None
    if before is None or after is None:
        return None
    return int((after - before) * 100 / max(elapsed, 0.1))


def write_byte(fd: int) -> bool:
    """One byte on the pipe that is mlx.launch's stdin; False when it cannot be written."""
    try:
        os.write(fd, b"\n")
    except OSError:
        return False
    return True


def quiet_launcher(nudge: Callable[[], bool], pid: int, wait: Wait = time.sleep) -> str | None:
    """Nudge until mlx.launch stops spinning. Returns the line that says so (or warns),
    None where there is nothing to tell (mlx.launch is gone, or its CPU cannot be read).
    `wait`: how to pass a second (the supervisor's goes on watching the job)."""
    before = cpu_percent(pid, 1, wait)
    if before is None:
        return None
    cpu = None
    for _ in range(3):
        if not nudge():
            return None
        cpu = cpu_percent(pid, 1, wait)
        if cpu is None:
            return None
        if cpu < SPINNING:
            return f"mlx.launch CPU: {before}% before the stdin byte, {cpu}% after (of one core)"
    return f"warning: mlx.launch still uses {cpu}% of a core while idle"
