"""PARALLELISM=auto's choice, kept across restarts: once the ranks are ready the split to
keep is recorded (run/auto-split: its kind, the ranks, MODEL), and a restart of the same
model on as many ranks (`./launch.sh restart`, the supervisor's own after a rank died, the
boot service's) tells every rank to keep it (KEPT_SPLIT_ENV); a plain `start` forgets it
and decides anew. The split kept is the one auto chooses by the figures the ranks measured
after the load (distributed/loader.py): the split that runs, unless the figures measured
before the load misled the choice, which a restart then corrects once.

Why: auto decides by figures the ranks measure at start, and where two splits are near,
or the link's measured cost varies (70-250 us a collective from one start to the next on
this project's 2-core VM, once in ten starts over 500 us), a restart could choose the
other split: every prefix-cache entry on disk, kept per split, was then unusable, and each
agent session after the restart prefilled its whole prompt again (docs/ARCHITECTURE.md,
"What restart restarts").
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from distributed.kept_split import KEPT_SPLIT_ENV
from ipc.status import Status

RECORD = "auto-split"


def record(run: Path, model: str, status: Status) -> None:
    """Keep the split to restart with of a ready job whose split PARALLELISM=auto chose
    (forget any other)."""
    plan = status.plan
    world, kind = int(plan.get("world_size", 1)), plan.get("restart_split", "")
    if plan.get("requested") != "auto" or world < 2 or not kind:
        forget(run)
        return
    (run / RECORD).write_text(f"{kind} {world} {model}\n")


def forget(run: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        (run / RECORD).unlink()


def kept(run: Path, model: str, world: int) -> dict[str, str]:
    """The ranks' environment for a restart of `model` on `world` ranks: the split to keep,
    where the last auto choice was for the same model and as many ranks ({} otherwise)."""
    try:
        kind, ranks, recorded = (run / RECORD).read_text().rstrip("\n").split(" ", 2)
    except (FileNotFoundError, ValueError):
        return {}
    same = ranks == str(world) and recorded == model and kind in ("tensor", "pipeline")
    return {KEPT_SPLIT_ENV: kind} if same else {}
