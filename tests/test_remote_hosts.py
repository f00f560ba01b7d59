"""launch.sh's remote mode across real hosts: two network namespaces, each with its sshd.

This machine is rank 0 (10.77.0.1 on the test's bridge); workers 10.77.0.2 and 10.77.0.3
are namespaces (tests/support/netns_hosts.py) reached over SSH with throwaway keys, each
with its own REMOTE_DIR. Each REMOTE_DIR starts with a hardlinked copy of the project's
.venv (the namespaces cannot reach PyPI), so the venv creation on a worker is not run
here; the code, config and .env arrive by rsync. The tests run in file order against one
cluster: faults before the start, then start, status, and the chaos of remote mode under
the supervisor (DEGRADED_MODE=auto, COLLECTIVE_TIMEOUT_SECONDS=5): a worker's link taken
down mid-stream (the cluster comes back without it), then brought back and another
worker's rank killed mid-stream (the cluster comes back by itself, and takes the left-out
worker back), 100 ms added on a worker's link while streaming (tc netem where the kernel
has it, else tests/support/delay_link.py); then stop. Each fault reports a row for
docs/RELIABILITY.md (tests/support/chaos.py). Needs root (skips with the reason otherwise).
"""

from __future__ import annotations

import os
import re
import signal
import statistics
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from config.settings import PROJECT_DIR
from ipc.processes import running
from tests.support import netns_hosts
from tests.support.chaos import (
    HealthWatch,
    Row,
    StreamEnd,
    ask,
    health,
    report,
    restart_row,
    stream_with_fault,
    stream_with_link_change,
    wait_ready_again,
    waited_and_succeeded,
)
from tests.support.delay_link import DelayedLink
from tests.support.netns_hosts import NetnsHosts, Worker
from tests.test_launch import START_TIMEOUT, Project, _ours
from tests.test_launch import project as launch_project  # noqa: F401 (fixture, used by name)

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

FAST = 30  # seconds: a fault must stop detect and start well before anything loads
COUNTING = "Count from 1 to 300, one number per line, with no other words."
COLLECTIVE_TIMEOUT = 5.0
# For the chaos tests: a stuck peer is detected within 5 s; a worker that does not answer
# is left out when the model fits the others; new requests wait for a restart.
CHAOS_ENV = (
    f"DEGRADED_MODE=auto\nCOLLECTIVE_TIMEOUT_SECONDS={COLLECTIVE_TIMEOUT}\n"
    "RESTART_WAIT_SECONDS=180\n"
)


class RemoteCluster:
    """The project copy in remote mode over the namespaced hosts."""

    def __init__(self, project: Project, hosts: NetnsHosts) -> None:
        self.project = project
        self.hosts = hosts
        self.root = project.root
        # our ssh (throwaway keys) first on PATH; 3 ranks share this machine's cores
        self.env = {
            "PATH": f"{hosts.bin}:{os.environ['PATH']}",
            "OPENBLAS_NUM_THREADS": "1",
        }
        self.url = f"http://127.0.0.1:{project.port}"

    def launch(self, *args: str, env: dict | None = None, timeout: float = 120):
        return self.project.launch(*args, env={**self.env, **(env or {})}, timeout=timeout)

    def rank_pid(self, worker: Worker) -> int:
        return int((worker.remote_dir / "run" / f"rank-{worker.index}.pid").read_text())

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", timeout=300)


def _remote_env(hosts: NetnsHosts) -> str:
    addresses = [w.address for w in hosts.workers]
    return (
        f"WORKER_HOSTS={','.join(addresses)}\n"
        f"WORKER_SSH={','.join('root@' + a for a in addresses)}\n"
        f"REMOTE_DIR={','.join(str(w.remote_dir) for w in hosts.workers)}\n"
    )


@pytest.fixture(scope="module")
def hosts() -> Iterator[NetnsHosts]:
    reason = netns_hosts.unavailable()
    if reason:
        pytest.skip(f"remote-mode tests need network namespaces with sshd: {reason}")
    made = NetnsHosts(count=2).up()
    try:
        venv = (PROJECT_DIR / ".venv").resolve()
        for worker in made.workers:  # no PyPI inside the namespaces: a hardlinked venv
            subprocess.run(
                ["cp", "-al", str(venv), str(worker.remote_dir / ".venv")],
                check=True,
                timeout=120,
            )
        yield made
    finally:
        made.down()


@pytest.fixture(scope="module")
def cluster(request: pytest.FixtureRequest, hosts: NetnsHosts) -> Iterator[RemoteCluster]:
    """test_launch's project copy (own .env, port, run/) in remote mode over `hosts`."""
    project: Project = request.getfixturevalue("launch_project")
    local_env = (project.root / ".env").read_text()
    (project.root / ".env").write_text(local_env + _remote_env(hosts) + CHAOS_ENV)
    remote = RemoteCluster(project, hosts)
    try:
        yield remote
    finally:
        remote.launch("stop", timeout=120)
        # back to local mode: `project`'s own final stop must not look for the workers
        (project.root / ".env").write_text(local_env)


def _server_processes(hosts: NetnsHosts, worker: Worker) -> dict[int, str]:
    return {pid: cmd for pid, cmd in hosts.commands(worker).items() if "server.py" in cmd}


def _mlx_metadata(worker: Worker) -> Path:
    found = list((worker.remote_dir / ".venv" / "lib").glob("python3*/site-packages/mlx-*"))
    found = [p / "METADATA" for p in found if p.name.endswith(".dist-info")]
    assert len(found) == 1, found
    return found[0]


def test_detect_reports_both_hosts(cluster: RemoteCluster) -> None:
    done = cluster.launch("detect")
    assert done.returncode == 0, done.stdout + done.stderr
    for worker in cluster.hosts.workers:
        line = rf"^root@{re.escape(worker.address)} \({re.escape(worker.address)}\): Linux "
        assert re.search(line + r".*mlx 0\.\d+.*\(venv\)", done.stdout, re.MULTILINE), done.stdout
    assert "detect: all hosts ready" in done.stdout


def test_a_host_whose_sshd_is_down_fails_detect_and_start_at_once(
    cluster: RemoteCluster,
) -> None:
    worker = cluster.hosts.workers[1]
    cluster.hosts.stop_sshd(worker)
    try:
        started = time.monotonic()
        done = cluster.launch("detect")
        assert time.monotonic() - started < FAST
        assert done.returncode == 1
        assert f"root@{worker.address}: unreachable over SSH" in done.stdout
        assert "Connection refused" in done.stdout
        assert f"root@{cluster.hosts.workers[0].address} (" in done.stdout  # the other is fine

        started = time.monotonic()
        done = cluster.launch("start")
        assert time.monotonic() - started < FAST
        assert done.returncode == 1
        assert f"error: cannot reach rank 2's host root@{worker.address} over SSH" in done.stderr
        assert "==> Ranks:" not in done.stdout
        assert not _ours(cluster.root)
        assert not (worker.remote_dir / "server.py").exists()  # nothing synced to it
    finally:
        cluster.hosts.start_sshd(worker)


def test_a_worker_with_another_mlx_version_is_refused_naming_both(
    cluster: RemoteCluster,
) -> None:
    worker = cluster.hosts.workers[1]
    metadata = _mlx_metadata(worker)
    original = metadata.read_bytes()
    here = re.search(rb"^Version: (\S+)$", original, re.MULTILINE).group(1).decode()
    # the venv is hardlinked to the project's: replace the file, never write through it
    metadata.unlink()
    metadata.write_bytes(re.sub(rb"(?m)^Version: \S+$", b"Version: 0.29.9", original))
    try:
        done = cluster.launch("detect")
        assert done.returncode == 1
        problem = f"{worker.address}: mlx 0.29.9, here {here}"
        assert f"problem: root@{problem}: delete {worker.remote_dir}/.venv" in done.stdout

        started = time.monotonic()
        done = cluster.launch("start", timeout=START_TIMEOUT)
        assert done.returncode == 1
        assert time.monotonic() - started < 120
        assert f"error: worker check failed: root@{problem}" in done.stderr, done.stderr
        assert "==> Ranks:" not in done.stdout
        assert not _ours(cluster.root)
        for each in cluster.hosts.workers:
            assert not _server_processes(cluster.hosts, each)
    finally:
        metadata.unlink()
        metadata.write_bytes(original)


def test_start_syncs_each_worker_and_serves_across_the_hosts(cluster: RemoteCluster) -> None:
    done = cluster.launch("start", timeout=START_TIMEOUT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "remote mode: this host + WORKER_HOSTS=10.77.0.2,10.77.0.3" in done.stdout
    assert "==> Ranks: 3 x server.py with mlx.launch (ring" in done.stdout
    for line in ("rank 0: 127.0.0.1 ips=10.77.0.1", "rank 1: root@10.77.0.2 ips=10.77.0.2"):
        assert line in done.stdout, done.stdout
    for worker in cluster.hosts.workers:
        for name in ("server.py", "launch.sh", ".env", "launcher/hostfile.py"):
            synced = worker.remote_dir / name
            assert synced.read_bytes() == (cluster.root / name).read_bytes(), name
        assert os.access(worker.remote_dir / "launch.sh", os.X_OK)
        assert not (worker.remote_dir / ".git").exists()
        # the rank runs inside the worker's namespace, in its own REMOTE_DIR
        pid = cluster.rank_pid(worker)
        assert pid in _server_processes(cluster.hosts, worker)
        assert os.readlink(f"/proc/{pid}/cwd") == str(worker.remote_dir)

    answer = _ask_capital(cluster)
    assert "Paris" in answer.choices[0].message.content
    assert answer.usage.completion_tokens > 0


def test_status_lists_every_hosts_rank(cluster: RemoteCluster) -> None:
    done = cluster.launch("status")
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.search(r"^rank 0: running on 127\.0\.0\.1 \(pid \d+\)", done.stdout, re.MULTILINE)
    for worker in cluster.hosts.workers:
        pid = cluster.rank_pid(worker)
        line = f"rank {worker.index}: running on root@{worker.address} (pid {pid})"
        assert line in done.stdout, done.stdout
    assert re.search(r"state ready, .*3 rank\(s\)", done.stdout), done.stdout
    assert "health: ready (HTTP 200)" in done.stdout


def _stream(cluster: RemoteCluster, fault) -> StreamEnd:
    return stream_with_fault(cluster.url, fault, prompt=COUNTING)


def _supervisor(cluster: RemoteCluster) -> dict:
    return httpx.get(f"{cluster.url}/cluster/status", timeout=10).json()["supervisor"]


def _link(worker: Worker, state: str) -> None:
    name = f"{netns_hosts.PREFIX}-v{worker.index}"
    subprocess.run(["ip", "link", "set", name, state], check=True)


def _only_the_jobs_rank(cluster: RemoteCluster, worker: Worker, timeout: float = 30) -> None:
    """Wait until the one server.py in the worker's namespace is the current job's rank."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if set(_server_processes(cluster.hosts, worker)) == {cluster.rank_pid(worker)}:
                return
        except (OSError, ValueError):
            pass
        assert time.monotonic() < deadline, cluster.hosts.commands(worker)
        time.sleep(0.2)


def test_a_workers_link_down_mid_stream_restarts_without_it(cluster: RemoteCluster) -> None:
    worker = cluster.hosts.workers[1]
    end = _stream(cluster, lambda: _link(worker, "down"))
    fault_at = time.monotonic() - end.after_fault_s
    assert end.error_code == "ranks_unavailable", end.how
    assert COLLECTIVE_TIMEOUT - 0.5 < end.after_fault_s < COLLECTIVE_TIMEOUT + 10
    with ThreadPoolExecutor(1) as pool:
        newcomer = pool.submit(ask, cluster.url)  # sent during the restart: it waits
        ready_after = wait_ready_again(cluster.url, fault_at)
        status, waited, reply = newcomer.result()
    assert status == 200, reply
    answer = _ask_capital(cluster)  # served by the 2 remaining ranks
    assert "Paris" in answer.choices[0].message.content
    left = f"rank 2 (root@{worker.address})"
    code, body = health(cluster.url)
    assert code == 200 and f"running without {left}" in body["reason"], body
    state = _supervisor(cluster)
    assert state["world_size"] == 2, state
    assert [(w["rank"], w["host"]) for w in state["left_out"]] == [(2, f"root@{worker.address}")]
    shown = cluster.launch("status")
    assert shown.returncode == 0, shown.stdout
    assert f"running without {left}" in shown.stdout, shown.stdout
    assert re.search(r"state ready, .*2 rank\(s\)", shown.stdout), shown.stdout
    assert f"rank 2: running on root@{worker.address}" not in shown.stdout
    log = (cluster.root / "supervisor.log").read_text()
    warning = rf"WARNING starting without {re.escape(left)}: the model fits the other 2 rank\(s\)"
    assert re.search(warning, log), log[-2000:]
    report(
        restart_row(
            "a worker's link down mid-stream (DEGRADED_MODE=auto)",
            end,
            ready_after,
            lost=f"{waited_and_succeeded(waited)}; the cluster serves on without the worker",
            leftovers="none (the cut-off rank ends by its own watchdog)",
        )
    )


def test_a_remote_rank_killed_mid_stream_restarts_and_takes_the_worker_back(
    cluster: RemoteCluster,
) -> None:
    left, first = cluster.hosts.workers[1], cluster.hosts.workers[0]
    _link(left, "up")  # it answers again: the next restart takes it back
    victim = cluster.rank_pid(first)
    end = _stream(cluster, lambda: os.kill(victim, signal.SIGKILL))
    fault_at = time.monotonic() - end.after_fault_s
    assert end.error_code == "ranks_unavailable", end.how
    assert end.after_fault_s < 10
    code, body = health(cluster.url)
    assert code == 503 and body["status"] == "restarting", body  # says so, never hangs
    status, waited, answer = ask(cluster.url)  # sent during the restart: it waits
    assert status == 200, answer
    ready_after = wait_ready_again(cluster.url, fault_at)
    state = _supervisor(cluster)
    assert state["world_size"] == 3 and not state["left_out"], state
    assert "running without" not in health(cluster.url)[1]["reason"]
    for worker in cluster.hosts.workers:  # the rank cut off with the link ended by itself
        _only_the_jobs_rank(cluster, worker)
    assert not running(victim)
    status = cluster.launch("status")
    assert status.returncode == 0, status.stdout
    assert "Paris" in _ask_capital(cluster).choices[0].message.content
    fault = "SIGKILL of a remote worker's rank (the left-out worker answers again)"
    lost = f"{waited_and_succeeded(waited)}; the restart took the left-out worker back"
    report(restart_row(fault, end, ready_after, lost))


def test_100_ms_on_a_workers_link_while_streaming(cluster: RemoteCluster) -> None:
    worker = cluster.hosts.workers[1]
    restarts = _supervisor(cluster)["restarts"]
    link = DelayedLink(cluster.hosts, worker, 0.1)
    with HealthWatch(cluster.url) as watch:
        before, during = stream_with_link_change(cluster.url, link, COUNTING, max_tokens=30)
    # at least one 100 ms wait per token (rank 2 sends every step's output on); loose bound
    assert during > before + 0.05, (before, during)
    assert watch.always_ready, "/health was not ready at some point under the delay"
    assert _supervisor(cluster)["restarts"] == restarts  # slower, not broken
    report(
        Row(
            fault=f"100 ms added on a worker's link while streaming ({link.kind})",
            client_saw=f"the stream slowed from {before * 1000:.0f} to {during * 1000:.0f} ms "
            "between chunks and finished with usage",
            detected_s=0.0,
            ready_again_s=0.0,
            lost="none",
            leftovers="none",
        )
    )


def _ask_capital(cluster: RemoteCluster):
    """A greedy chat completion through the real API, asking for France's capital."""
    return cluster.client().chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=16,
        temperature=0,
    )


def _decode_ms(cluster: RemoteCluster, runs: int = 3) -> list[float]:
    """Per-token decode times (ms) of `runs` 64-token answers, one at a time, after a warm-up."""
    client, times = cluster.client(), []
    for _ in range(runs + 1):
        answer = client.chat.completions.create(
            model="default",
            messages=[{"role": "user", "content": COUNTING}],
            max_tokens=64,
            temperature=0,
        )
        rate = answer.model_extra["performance"]["generation_tokens_per_second"]
        times.append(1000 / rate)
    return times[1:]


def _summary(times: list[float]) -> str:
    return f"{statistics.median(times):.1f} ({', '.join(f'{t:.0f}' for t in times)})"


@pytest.mark.skipif(
    os.environ.get("REMOTE_DECODE_COMPARE") != "1",
    reason="measurement, not a check: REMOTE_DECODE_COMPARE=1 ./test.sh -k remote -s",
)
def test_decode_time_across_hosts_against_local_ranks(cluster: RemoteCluster) -> None:
    remote = _decode_ms(cluster)
    assert cluster.launch("stop").returncode == 0
    local_env = {"WORKER_HOSTS": "", "WORKER_SSH": "", "REMOTE_DIR": "~/mlx-ring"}
    local_env["NUM_DEVICES"] = "3"
    try:
        done = cluster.launch("start", env=local_env, timeout=START_TIMEOUT)
        assert done.returncode == 0, done.stdout + done.stderr
        local = _decode_ms(cluster)
    finally:
        cluster.launch("stop", env=local_env)
    print(
        "\nper-token decode, default model, 3 ranks, 64-token answers, median of 3 (all), ms: "
        f"namespaced hosts {_summary(remote)}, local ranks {_summary(local)}"
    )
    done = cluster.launch("start", timeout=START_TIMEOUT)  # back to remote for the next test
    assert done.returncode == 0, done.stdout + done.stderr


def test_stop_ends_the_remote_ranks_inside_each_namespace(cluster: RemoteCluster) -> None:
    pids = {worker.index: cluster.rank_pid(worker) for worker in cluster.hosts.workers}
    done = cluster.launch("stop")
    assert done.returncode == 0, done.stdout + done.stderr
    for worker in cluster.hosts.workers:
        assert not running(pids[worker.index])
        assert not _server_processes(cluster.hosts, worker), cluster.hosts.commands(worker)
        assert not list((worker.remote_dir / "run").glob("rank-*.pid"))
    assert not _ours(cluster.root)
    again = cluster.launch("stop")
    assert again.returncode == 0
    assert "nothing was running" in again.stdout
