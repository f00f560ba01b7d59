"""Stop mlx.launch's relay busy loop: one byte on the FIFO that is its stdin, then a check.

mlx.launch's relay threads select() on each rank's stdin pipe, which is always writable,
so it spins (a core or more) while the ranks idle. The ranks close their stdin at start;
once one byte reaches mlx.launch's stdin, its write to each closed pipe fails and it stops
watching them. A rank that had not closed its stdin yet keeps its pipe watched, so a
second byte follows while mlx.launch still spins. CPU is read from /proc (Linux only).

    python -m launcher.quiet FIFO PID      prints "mlx.launch CPU: A% before ..., B% after"
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

SPINNING = 20  # % of one core above which mlx.launch is still busy-looping


def cpu_percent(pid: int, seconds: float) -> int | None:
    """Whole-process CPU over `seconds` as % of one core; None where /proc cannot tell."""

    def ticks() -> int | None:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            return None
        return int(fields[11]) + int(fields[12])

    before = ticks()
    if before is None:
        return None
    time.sleep(seconds)
    after = ticks()
    if after is None:
        return None
    return (after - before) * 100 // os.sysconf("SC_CLK_TCK") // max(1, round(seconds))


def nudge(fifo: Path) -> bool:
    try:
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        os.write(fd, b"\n")
    finally:
        os.close(fd)
    return True


def main(argv: list[str]) -> int:
    fifo, pid = Path(argv[0]), int(argv[1])
    before = cpu_percent(pid, 1)
    cpu = None
    for _ in range(3):
        if not nudge(fifo):
            return 0
        cpu = cpu_percent(pid, 1)
        if cpu is None:
            return 0
        if cpu < SPINNING:
            print(f"mlx.launch CPU: {before}% before the stdin byte, {cpu}% after (of one core)")
            return 0
    print(f"warning: mlx.launch still uses {cpu}% of a core while idle", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
