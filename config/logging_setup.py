"""One log line per event, each carrying the host and the process's role (rank or api)."""

from __future__ import annotations

import logging
import socket
import sys


def setup_logging(level: str, role: str) -> logging.Logger:
    """Configure the root logger: `time host role LEVEL message`; returns the project logger."""
    host = socket.gethostname()
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(
        logging.Formatter(
            f"%(asctime)s {host} {role} %(levelname)s %(message)s", datefmt="%Y-%m-%d %H:%M:%S"
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for noisy in ("httpx", "httpcore", "huggingface_hub", "filelock"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
    return logging.getLogger("ring")
