"""PARALLELISM=auto's choice kept across restarts (launcher/auto_split.py): recorded from a
ready job's status, given back to the ranks of a restart of the same model on as many
ranks, forgotten for a choice that was not auto's."""

from __future__ import annotations

from pathlib import Path

from distributed.kept_split import KEPT_SPLIT_ENV
from ipc.status import RankState, Status
from launcher import auto_split


def status(strategy: str, requested: str = "auto", world: int = 2) -> Status:
    """A ready job's status whose plan auto would keep as it runs (distributed/loader.py)."""
    kind = "pipeline" if strategy == "pipeline" else "tensor" if world > 1 else ""
    plan = {"strategy": strategy, "requested": requested, "world_size": world}
    plan["restart_split"] = kind if requested == "auto" else ""
    return Status(state=RankState.READY, model_id="m", world_size=world, plan=plan)


def test_a_restart_of_the_same_model_on_as_many_ranks_keeps_the_split(tmp_path: Path) -> None:
    assert auto_split.kept(tmp_path, "/models/a", 2) == {}  # nothing recorded yet
    auto_split.record(tmp_path, "/models/a", status("pipeline"))
    assert auto_split.kept(tmp_path, "/models/a", 2) == {KEPT_SPLIT_ENV: "pipeline"}
    assert auto_split.kept(tmp_path, "/models/a", 3) == {}  # another number of ranks
    assert auto_split.kept(tmp_path, "/models/b", 2) == {}  # another model
    auto_split.record(tmp_path, "", status("tensor-uneven"))  # the default model
    assert auto_split.kept(tmp_path, "", 2) == {KEPT_SPLIT_ENV: "tensor"}
    # where the figures measured after the load chose otherwise, a restart takes that one
    corrected = status("pipeline")
    corrected.plan["restart_split"] = "tensor"
    auto_split.record(tmp_path, "m", corrected)
    assert auto_split.kept(tmp_path, "m", 2) == {KEPT_SPLIT_ENV: "tensor"}


def test_a_split_auto_did_not_choose_is_not_kept(tmp_path: Path) -> None:
    auto_split.record(tmp_path, "m", status("tensor-even"))
    auto_split.record(tmp_path, "m", status("pipeline", requested="pipeline"))
    assert auto_split.kept(tmp_path, "m", 2) == {}  # PARALLELISM=pipeline: nothing to keep
    auto_split.record(tmp_path, "m", status("single", world=1))
    assert not (tmp_path / auto_split.RECORD).exists()
    (tmp_path / auto_split.RECORD).write_text("garbled\n")
    assert auto_split.kept(tmp_path, "m", 2) == {}
