"""Ranks sharing a host's cores time a prefill's work at once (distributed/shared_cores.py):
the same count of runs on every rank, from one barrier to the next, less the barrier's own
time, so every rank reads one figure."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from bench.local_ranks import run_local_ranks
from distributed.shared_cores import AT_ONCE_TIMINGS, at_once_ms


class SlowTurns:
    """One rank whose barrier takes `barrier_s` and whose peers asked for `more` runs
    than it did."""

    def __init__(self, barrier_s: float, more: int) -> None:
        self.barrier_s, self.more, self.asked = barrier_s, more, 0

    def together(self) -> None:
        time.sleep(self.barrier_s)

    def agree(self, count: int) -> int:
        self.asked = count
        return count + self.more

    def each_alone(self, run: Any) -> Any:
        return run()


def test_work_timed_at_once_runs_the_agreed_count_and_leaves_the_barrier_out() -> None:
    runs = 0

    def run() -> None:
        nonlocal runs
        runs += 1
        time.sleep(0.002)

    turns = SlowTurns(barrier_s=0.1, more=25)
    ms = at_once_ms(turns, run)
    # two first runs, then the agreed count (more than this rank asked) in each timing
    assert runs == 2 + AT_ONCE_TIMINGS * (turns.asked + 25)
    # 2 ms a run; with the barriers' 200 ms a timing left in it would read 3.2 ms or more
    assert 1.9 <= ms < 2.8


ROOT = Path(__file__).resolve().parents[1]
RANK_SCRIPT = f"""
import json, sys, time
sys.path.insert(0, {str(ROOT)!r})
import mlx.core as mx
from distributed.shared_cores import GroupTurns, at_once_ms
group = mx.distributed.init(backend="ring")
turns = GroupTurns(group)
rank = group.rank()
agreed = turns.agree(10 + rank)
ms = at_once_ms(turns, lambda: time.sleep(0.001 + 0.004 * rank))  # rank 1 the slower
with open(sys.argv[1] + f"/rank{{rank}}.json", "w") as f:
    json.dump({{"agreed": agreed, "ms": ms}}, f)
"""


def test_ranks_timing_at_once_agree_on_the_count_and_read_the_slowest_ranks_time(
    tmp_path: Path,
) -> None:
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    run_local_ranks(2, [sys.executable, str(script), str(tmp_path)])
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [g["agreed"] for g in got] == [11, 11]
    # each timing lasts as long as rank 1's runs (5 ms each): both ranks read it
    assert got[0]["ms"] == pytest.approx(got[1]["ms"], rel=0.05)
    assert 4.5 <= got[0]["ms"] < 10.0
