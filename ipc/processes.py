"""Whether a process still runs, by its pid. Standard library only: scripts/api_check.py
uses it too, and that script starts without the venv's packages."""

from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """True while `pid` names a process (one we may not signal counts: it exists)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
