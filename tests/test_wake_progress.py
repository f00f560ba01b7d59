"""The wake channel's ready reports carry each worker's load progress to rank 0 (sockets
in one process: the same code the ranks run), and rank 0's boot status shows it."""

from __future__ import annotations

import socket
import threading

from config.settings import Settings
from distributed.group import RankIdentity
from distributed.wake import WakeReceiver, WakeSender
from leader.booting import Booting


def test_progress_lines_reach_rank_0_before_the_ready_reports() -> None:
    pairs = [socket.socketpair() for _ in range(2)]
    sender = WakeSender([ours for ours, _ in pairs])
    workers = [WakeReceiver(theirs) for _, theirs in pairs]
    booting = Booting(Settings(_env_file=None), RankIdentity(0, 3, "here", "ring"))
    wait = sender.collect_ready_in_background(booting.on_progress)

    def load(rank: int, worker: WakeReceiver) -> None:
        for done in range(1, 4):
            worker.send_progress(done, 3)
        worker.send_ready({"rank": rank, "host": "there"})

    threads = [threading.Thread(target=load, args=(r, w)) for r, w in enumerate(workers, 1)]
    for thread in threads:
        thread.start()
    reports = wait()
    for thread in threads:
        thread.join()
    assert [report["rank"] for report in reports] == [1, 2]
    loading = booting.status().loading
    assert [(p.rank, p.done, p.total) for p in loading] == [(1, 3, 3), (2, 3, 3)]
    assert booting.status().state == "loading"


def test_a_worker_that_leaves_during_its_load_is_named() -> None:
    ours, theirs = socket.socketpair()
    sender = WakeSender([ours])
    wait = sender.collect_ready_in_background(lambda *_: None)
    WakeReceiver(theirs).send_progress(1, 30)
    theirs.close()
    try:
        wait()
    except Exception as exc:  # noqa: BLE001 - WakeError expected
        assert "rank 1 closed the wake channel before it was ready" in str(exc)
    else:
        raise AssertionError("a closed worker must be reported")
