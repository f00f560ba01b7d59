"""The collective watchdog in a process of its own: a guard that outlives the timeout ends
the process with the watchdog's status and a line naming the collective; guards that end
in time, however many, end nothing. (A rank stuck for real: tests/test_chaos.py.)"""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import logging, sys, time
    from distributed.watchdog import CollectiveWatchdog
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    dog = CollectiveWatchdog(float(sys.argv[1]), exit_code=7)
    for _ in range(20000):  # quick guards, as an expert split's routing takes them
        with dog.guard("quick"):
            pass
    with dog.guard("stuck all_sum"):
        time.sleep(float(sys.argv[2]))
    print("survived")
    """
)


def _run(timeout_s: float, held_s: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", SCRIPT, str(timeout_s), str(held_s)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_guard_past_the_timeout_ends_the_process_and_names_it() -> None:
    done = _run(timeout_s=0.3, held_s=5.0)
    assert done.returncode == 7, done.stderr
    assert "collective 'stuck all_sum' did not finish" in done.stderr
    assert "survived" not in done.stdout


def test_guards_that_end_in_time_end_nothing() -> None:
    done = _run(timeout_s=1.0, held_s=0.2)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "survived" and "did not finish" not in done.stderr
