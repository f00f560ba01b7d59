"""The processes that belong to a copy of the project (their command line names its
directory, or they run in it), from Linux's /proc, and from ps and lsof on macOS. The
tests use it to show that nothing was left running; a system where neither can be read
raises (an empty list would pass those checks without looking)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def _linux() -> list[tuple[int, str, str | None, str]]:
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            command = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue  # ended while we looked
        try:
            cwd: str | None = os.readlink(proc / "cwd")
        except OSError:
            cwd = None  # another user's process, or ended
        found.append((int(proc.name), command, cwd, state))
    return found


def _ps_and_lsof() -> list[tuple[int, str, str | None, str]]:
    listing = subprocess.run(
        ["ps", "-axww", "-o", "pid=,stat=,command="], capture_output=True, text=True, check=True
    ).stdout
    # lsof -Fpn: "p<pid>" then "n<cwd>" lines; exit 1 only says some were not readable
    cwds: dict[int, str] = {}
    pid = 0
    lsof = subprocess.run(["lsof", "-a", "-d", "cwd", "-Fpn"], capture_output=True, text=True)
    for line in lsof.stdout.splitlines():
        if line.startswith("p"):
            pid = int(line[1:])
        elif line.startswith("n"):
            cwds[pid] = line[1:]
    found = []
    for row in listing.splitlines():
        parts = row.split(None, 2)
        if len(parts) == 3:
            found.append((int(parts[0]), parts[2], cwds.get(int(parts[0])), parts[1][0]))
    return found


def processes() -> list[tuple[int, str, str | None, str]]:
    """(pid, command line, working directory or None, state letter) of every process."""
    return _linux() if sys.platform == "linux" else _ps_and_lsof()


def project_processes(root: Path) -> list[tuple[int, str]]:
    """(pid, command line) of the running processes (zombies aside) of the copy at `root`."""
    return [
        (pid, command)
        for pid, command, cwd, state in processes()
        if state != "Z" and (str(root) in command or cwd == str(root)) and pid != os.getpid()
    ]
