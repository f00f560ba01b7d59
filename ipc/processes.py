"""Whether a process still runs, by its pid, and what it uses (state, CPU time, memory):
from Linux's /proc, and from `ps` on macOS and other systems. Standard library only:
scripts/api_check.py uses it too, and that script starts without the venv's packages."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def pid_alive(pid: int) -> bool:
    """True while `pid` names a process (one we may not signal counts: it exists)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# ---- what a process is doing: Linux's /proc, else POSIX ps (macOS, the BSDs) -------------
# Each answers None where the process is gone, and raises OSError where this system cannot
# tell (no /proc and no ps): "cannot tell" is never taken for an answer.

LINUX = sys.platform == "linux"


def _proc_stat(pid: int) -> list[str] | None:
    """Linux's /proc/PID/stat fields after the command name (field 3 on: state first)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None


def _ps(pid: int, field: str) -> str | None:
    """One `ps -o FIELD=` column for `pid`; None where ps lists no such process."""
    done = subprocess.run(
        ["ps", "-o", f"{field}=", "-p", str(pid)], capture_output=True, text=True, check=False
    )
    return done.stdout.strip() or None


def state(pid: int) -> str | None:
    """The process's state letter ("R", "S", "Z" for a zombie, ...); None where it is gone."""
    if LINUX:
        fields = _proc_stat(pid)
        return fields[0] if fields else None
    column = _ps(pid, "stat")
    return column[0] if column else None


def running(pid: int) -> bool:
    """True while `pid` is a process that has not exited (a zombie has)."""
    return state(pid) not in (None, "Z")


def cpu_seconds(pid: int) -> float | None:
    """User plus system CPU time the process has used; None where it is gone."""
    if LINUX:
        fields = _proc_stat(pid)
        if fields is None:
            return None
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    column = _ps(pid, "time")  # [[dd-]hh:]mm:ss[.ss]
    if column is None:
        return None
    days, _, clock = column.rpartition("-")
    seconds = 0.0
    for part in clock.split(":"):
        seconds = seconds * 60 + float(part)
    return seconds + int(days or 0) * 86400


def rss_bytes(pid: int) -> int | None:
    """Resident memory of the process; None where it is gone."""
    if LINUX:
        try:
            lines = Path(f"/proc/{pid}/status").read_text().splitlines()
        except (FileNotFoundError, ProcessLookupError):
            return None
        found = [line.split()[1] for line in lines if line.startswith("VmRSS:")]
        return int(found[0]) * 1024 if found else None
    column = _ps(pid, "rss")  # KiB
    return int(column) * 1024 if column else None
