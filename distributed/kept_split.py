"""The split a restart keeps: PARALLELISM=auto's choice before the restart ("tensor" or
"pipeline"), which the launcher gives every rank in KEPT_SPLIT_ENV where the model and the
ranks are the same (launcher/auto_split.py), and distributed/plan_speed.py's choose_plan
takes where it fits. Its own module so that the launcher reads the name without MLX."""

from __future__ import annotations

import os

KEPT_SPLIT_ENV = "AUTO_SPLIT_BEFORE"


def kept_split() -> str:
    """The split to keep ("" at a plain start)."""
    return os.environ.get(KEPT_SPLIT_ENV, "")
