"""Clusters that end: SIGTERM to rank 0, a dead worker, a stuck collective; and the
keep-warm step of an idle rank 0 (2 ranks of server.py over the ring backend on 127.0.0.1,
each test its own short-lived cluster)."""

from __future__ import annotations

import os
import signal
import time

import pytest

from ipc.processes import running
from ipc.protocol import Started
from launcher.local_cluster import Cluster
from tests.support.rank_requests import CLUSTER_ENV, greedy, run_requests

pytestmark = pytest.mark.cluster


def test_sigterm_to_rank_0_ends_every_rank(tmp_path, tiny_llama):
    model = tiny_llama
    with Cluster(model, ranks=2, env=CLUSTER_ENV) as cluster:
        pids = cluster.rank_pids()
        client = cluster.client()
        client.send(greedy("running", "go", 400))
        assert isinstance(client.recv(), Started)
        started = time.monotonic()
        os.kill(pids[0], signal.SIGTERM)
        assert cluster.process.wait(10) == 0
        assert time.monotonic() - started < 5
        for pid in pids.values():
            assert not running(pid)  # exited: reaped, or a zombie
        log = cluster.log_path.read_text()
    # mlx.launch exits 0 even when a rank fails, so the log is the witness.
    assert "r1 INFO stop plan received; exiting" in log, log
    assert "exited with code" not in log, log


def test_idle_rank_0_keeps_the_model_warm(tmp_path, tiny_llama):
    # KEEP_WARM_SECONDS: idle that long, rank 0 runs a one-token request of its own, so
    # every rank steps with no client at all; nothing is sent and nothing logged at INFO.
    model = tiny_llama
    with Cluster(model, ranks=2, env=CLUSTER_ENV | {"KEEP_WARM_SECONDS": "1"}) as cluster:
        deadline = time.monotonic() + 30
        while cluster.status().last_step_ms is None and time.monotonic() < deadline:
            time.sleep(0.2)
        status = cluster.status()
        with cluster.client() as client:  # and clients are served as before
            _, tokens, final = run_requests(client, [greedy("after", "go", 4)])
        log = cluster.log_path.read_text()
    assert status.last_step_ms is not None and status.active_requests == 0
    assert final["after"].finish_reason in ("length", "stop") and tokens["after"]
    assert "keep-warm" not in log, log


def test_a_dead_worker_ends_rank_0(tmp_path, tiny_llama):
    model = tiny_llama
    with Cluster(model, ranks=2, env=CLUSTER_ENV) as cluster:
        os.kill(cluster.rank_pids()[1], signal.SIGKILL)
        cluster.process.wait(10)
        log = cluster.log_path.read_text()
    assert "r0 ERROR rank 1 exited (its wake channel closed); stopping" in log, log


def test_stuck_collective_ends_the_rank(tmp_path, tiny_llama):
    model = tiny_llama
    env = CLUSTER_ENV | {"COLLECTIVE_TIMEOUT_SECONDS": "2"}
    with Cluster(model, ranks=2, env=env) as cluster:
        pids = cluster.rank_pids()
        os.kill(pids[1], signal.SIGSTOP)  # rank 1 will never join the next broadcast
        try:
            client = cluster.client()
            client.send(greedy("stuck", "go", 8))
            deadline = time.monotonic() + 15
            while running(pids[0]) and time.monotonic() < deadline:
                time.sleep(0.1)
            rank_0_ended = not running(pids[0])
        finally:
            os.kill(pids[1], signal.SIGCONT)
        cluster.process.wait(10)
        log = cluster.log_path.read_text()
    assert rank_0_ended, log
    assert "Node with rank 0 exited with code 3" in log, log
    assert "collective 'plan broadcast' did not finish within COLLECTIVE_TIMEOUT_SECONDS" in log
