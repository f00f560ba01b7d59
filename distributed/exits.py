"""How a rank ends on purpose: one log line, then the process exits at once with a code
that says why (`launch.sh logs` and the supervisor's log show both).

`os._exit`, not `sys.exit`: threads blocked inside MLX (a collective, the socket thread's
loop) cannot be joined, and a rank that must leave should not wait for them.
"""

from __future__ import annotations

import logging
import os
from typing import NoReturn

EXIT_BAD_MODEL = 2  # the model cannot be resolved, planned or loaded here
EXIT_COLLECTIVE_TIMEOUT = 3  # a collective outlived COLLECTIVE_TIMEOUT_SECONDS (watchdog.py)
EXIT_DIVERGED = 4  # this rank's batch is not rank 0's (a step plan it cannot apply)
EXIT_PEER_GONE = 5  # another rank of the job exited, so the job cannot go on

log = logging.getLogger("ring")


def die(code: int, message: str, level: int = logging.ERROR) -> NoReturn:
    """Log one line and end the process now."""
    log.log(level, message)
    for handler in logging.getLogger().handlers:
        handler.flush()
    os._exit(code)


def peer_lost(exc: RuntimeError) -> bool:
    """MLX's distributed backends report a lost peer as a RuntimeError named `[backend] ...`
    (e.g. `[ring] connection to a peer was lost`) from inside a collective."""
    return str(exc).startswith("[") or "peer" in str(exc)
