"""launch.sh's remote mode across real hosts: two network namespaces, each with its sshd.

This machine is rank 0 (10.77.0.1 on the test's bridge); workers 10.77.0.2 and 10.77.0.3
are namespaces (tests/support/netns_hosts.py) reached over SSH with throwaway keys, each
with its own REMOTE_DIR. Each REMOTE_DIR starts with a hardlinked copy of the project's
.venv (the namespaces cannot reach PyPI), so the venv creation on a worker is not run
here; the code, config and .env arrive by rsync. The tests run in file order against one
cluster: faults before the start, then start, status, a rank killed mid-stream, restart
and stop. Needs root (skips with the reason otherwise).
"""

from __future__ import annotations

import os
import re
import signal
import statistics
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from config.settings import PROJECT_DIR
from tests.support import netns_hosts
from tests.support.netns_hosts import NetnsHosts, Worker
from tests.test_launch import START_TIMEOUT, Project, _alive, _ours
from tests.test_launch import project as launch_project  # noqa: F401 (fixture, used by name)

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

FAST = 30  # seconds: a fault must stop detect and start well before anything loads
COUNTING = "Count from 1 to 300, one number per line, with no other words."


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
    (project.root / ".env").write_text(local_env + _remote_env(hosts))
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


def test_a_remote_rank_killed_mid_stream_gives_an_error_event_and_503(
    cluster: RemoteCluster,
) -> None:
    worker = cluster.hosts.workers[1]
    stream = cluster.client().chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": COUNTING}],
        max_tokens=600,
        temperature=0,
        stream=True,
    )
    received, killed_at = 0, None
    with pytest.raises(openai.APIError) as error:
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                received += 1
            if received == 5 and killed_at is None:
                os.kill(cluster.rank_pid(worker), signal.SIGKILL)
                killed_at = time.monotonic()
    assert killed_at is not None, "the stream ended before the rank was killed"
    assert time.monotonic() - killed_at < 10
    assert "ranks" in str(error.value.message).lower(), error.value.message
    status = None
    while time.monotonic() - killed_at < 10:
        status = httpx.get(f"{cluster.url}/health", timeout=2).status_code
        if status == 503:
            break
        time.sleep(0.2)
    assert status == 503, f"/health answered {status} 10 s after the kill"


def test_restart_brings_the_cluster_back(cluster: RemoteCluster) -> None:
    done = cluster.launch("restart", timeout=START_TIMEOUT)
    assert done.returncode == 0, done.stdout + done.stderr
    status = cluster.launch("status")
    assert status.returncode == 0, status.stdout
    assert "Paris" in _ask_capital(cluster).choices[0].message.content


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
        assert not _alive(pids[worker.index])
        assert not _server_processes(cluster.hosts, worker), cluster.hosts.commands(worker)
        assert not list((worker.remote_dir / "run").glob("rank-*.pid"))
    assert not _ours(cluster.root)
    again = cluster.launch("stop")
    assert again.returncode == 0
    assert "nothing was running" in again.stdout
