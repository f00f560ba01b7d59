"""mlx.launch's quiet check (launcher/quiet.py) on real processes: it passes its seconds
through the caller's wait (the supervisor's goes on watching the job), and a launcher that
is gone ends the check at once, with nothing to tell."""

from __future__ import annotations

import subprocess
import sys
import time

from launcher.quiet import quiet_launcher

IDLE = [sys.executable, "-c", "import time; time.sleep(60)"]


def test_an_idle_launcher_is_reported_through_the_callers_wait() -> None:
    idle = subprocess.Popen(IDLE)
    waited: list[float] = []
    try:

        def wait(seconds: float) -> None:
            waited.append(seconds)
            time.sleep(0.2)  # a wait may come back sooner; the rate counts the time passed

        line = quiet_launcher(lambda: idle.poll() is None, idle.pid, wait)
    finally:
        idle.kill()
        idle.wait()
    assert waited == [1, 1]
    assert line is not None and line.endswith("0% after (of one core)"), line


def test_a_launcher_gone_during_the_check_ends_it_at_once() -> None:
    doomed = subprocess.Popen(IDLE)

    def wait(seconds: float) -> None:  # mlx.launch killed meanwhile; the caller reaps it
        doomed.kill()
        doomed.wait()

    start = time.monotonic()
    line = quiet_launcher(lambda: doomed.poll() is None, doomed.pid, wait)
    assert line is None and time.monotonic() - start < 1.0
