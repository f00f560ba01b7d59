"""A bench module run as a user runs it: `python -m bench.<module>` from the project."""

from __future__ import annotations

import subprocess
import sys

from config.settings import PROJECT_DIR


def run_bench(module: str, *args: str, timeout: float | None = None) -> str:
    """`python -m bench.<module> args`'s output, which must exit 0."""
    done = subprocess.run(
        [sys.executable, "-m", f"bench.{module}", *args],
        cwd=PROJECT_DIR,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout
