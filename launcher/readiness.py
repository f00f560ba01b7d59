"""What the supervisor looks for while a job of the ranks comes up, and the lines start's
progress (launcher/start_progress.py) shows for it: rank 0's socket, every rank's load,
rank 0's warm-up (leader/warmup.py), ready."""

from __future__ import annotations

import time

from ipc.status import RankState, Status
from launcher.job import RankJob
from launcher.start_progress import Progress

# Before rank 0's socket is up, mlx.launch is nudged this often: the ranks close their
# stdin as they start, so a byte after that ends its spinning. Nudged only at the socket,
# it still spun through the ranks' first probe (the link read 584-605 us a collective
# against 72-80 us after the load), and PARALLELISM=auto chose by that figure.
NUDGE_EVERY_S = 1.0


class ReadyWatch:
    """One job's way to ready, looked at again and again (the supervisor's loop)."""

    def __init__(self, job: RankJob, progress: Progress) -> None:
        self.job = job
        self.progress = progress
        self.socket_seen = False
        self.warming_seen = False
        self.nudged = time.monotonic()

    def look(self) -> Status | None:
        """One look: a progress line for each stage reached; rank 0's status once ready."""
        job = self.job
        if not job.socket_exists():
            if time.monotonic() - self.nudged >= NUDGE_EVERY_S:
                job.nudge()
                self.nudged = time.monotonic()
            return None
        if not self.socket_seen:
            self.progress.say("    socket is up; waiting for every rank to load")
            self.socket_seen = True
            # Again now, not only once ready: rank 0 binds its socket after the group
            # handshake, which every rank enters with its stdin closed, and a spinning
            # mlx.launch takes a core from the load. The check that it worked waits for
            # ready (it takes seconds).
            job.nudge()
        status = job.status()
        if status is None:
            return None
        if status.state == RankState.WARMING and not self.warming_seen:
            self.warming_seen = True
            self.progress.say(
                "==> Warm-up: every rank runs rank 0's first requests (kernels compiled, "
                "decode traced) before ready"
            )
        if status.state != RankState.READY:
            return None
        if status.warm_up:
            if not self.warming_seen:  # it began and ended between two looks
                self.progress.say("==> Warm-up: every rank runs rank 0's first requests")
            self.progress.say(f"    warmed up: {status.warm_up}")
        self.progress.say(f"    ready: {status.model_id} on {status.world_size} rank(s)")
        return status
