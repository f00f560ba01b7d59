"""The first start's progress, from the supervisor to `./launch.sh start`.

The supervisor appends the lines launch.sh prints (`==> step`, `    detail`) to
run/start.progress while it brings the cluster up the first time, then `@ready`, or
`@failed<TAB>log<TAB>reason`. `follow` prints them as they come and returns 0 once ready;
on a failure it writes the reason and the log to show to run/start.failed (two lines) for
launch.sh's abort, and returns 1. It polls the file (5 times a second) only while
launch.sh waits: nothing reads it afterwards.
"""

from __future__ import annotations

import time
from pathlib import Path

from ipc.processes import pid_alive
from launcher.paths import Paths

READY = "@ready"
FAILED = "@failed"


class Progress:
    """The supervisor's side: lines until the first start ends, then nothing."""

    def __init__(self, path: Path, enabled: bool) -> None:
        self.path = path
        self.open = enabled

    def say(self, line: str) -> None:
        if self.open:
            with open(self.path, "a") as out:
                out.write(line + "\n")

    def ready(self) -> None:
        self.say(READY)
        self.open = False

    def failed(self, reason: str, log: Path) -> None:
        self.say(f"{FAILED}\t{log}\t{' '.join(reason.split())}")
        self.open = False


def follow(paths: Paths, supervisor_pid: int, timeout_s: float) -> int:
    """launch.sh's side: print the progress; 0 once ready, 1 (run/start.failed) if not."""
    deadline = time.monotonic() + timeout_s
    offset = 0
    failed = paths.run / "start.failed"
    failed.unlink(missing_ok=True)
    while True:
        try:
            text = paths.progress.read_text()
        except FileNotFoundError:
            text = ""
        complete = text[offset:].rsplit("\n", 1)[0] if "\n" in text[offset:] else ""
        if complete:
            offset += len(complete) + 1
        for line in complete.splitlines():
            if line == READY:
                return 0
            if line.startswith(FAILED + "\t"):
                _, log, reason = line.split("\t", 2)
                failed.write_text(f"{reason}\n{log}\n")
                return 1
            print(line, flush=True)
        if not pid_alive(supervisor_pid):
            reason = f"the supervisor (pid {supervisor_pid}) exited during start"
            failed.write_text(f"{reason}\n{paths.supervisor_log}\n")
            return 1
        if time.monotonic() > deadline:
            reason = f"the cluster was not ready within {timeout_s:.0f} s"
            failed.write_text(f"{reason}\n{paths.server_log}\n")
            return 1
        time.sleep(0.2)
