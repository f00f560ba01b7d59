"""The supervisor's parts without ranks: restart policy, state file, the availability it
adds to the API (a real api.py reading a state file), the fit check of a smaller cluster,
the settings of a job that leaves a worker out, why a job ended, and the service files."""

from __future__ import annotations

import os
import plistlib
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from config.settings import Settings, load_settings
from distributed.hosts import RankHost
from distributed.memory import check_fit
from gateway.availability import availability, supervised, waits_for_restart
from ipc.supervisor_state import (
    STATE_ENV,
    Failure,
    LeftOut,
    StateReader,
    SupervisorState,
    read_state,
    write_state,
)
from launcher import remote, service
from launcher.degraded import choose_workers, fit_problem
from launcher.job import RankJob
from launcher.paths import Paths
from launcher.restart_policy import RestartPolicy
from tests.support.api_server import running_api

CHAT = {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def _state(phase: str, **fields: object) -> SupervisorState:
    return SupervisorState(pid=os.getpid(), phase=phase, since=time.time(), **fields)


# ---- restart policy ------------------------------------------------------------------------


def test_backoff_doubles_to_a_minute_and_resets_when_up() -> None:
    policy = RestartPolicy(limit=100, window_s=600)
    delays = []
    for n in range(9):
        policy.failed(float(n))
        delays.append(policy.delay())
    assert delays == [1, 2, 4, 8, 16, 32, 60, 60, 60]
    policy.came_up()
    assert policy.delay() == 0
    policy.failed(10.0)
    assert policy.delay() == 1


def test_crash_loop_counts_failures_in_the_window_only() -> None:
    policy = RestartPolicy(limit=3, window_s=600)
    policy.failed(0.0)
    policy.failed(100.0)
    assert not policy.gave_up(100.0)
    policy.failed(650.0)  # the first left the window
    assert not policy.gave_up(650.0) and policy.recent_failures(650.0) == 2
    policy.failed(690.0)  # 100, 650 and 690 lie within 600 s
    assert policy.gave_up(690.0)


def test_waiting_for_a_worker_backs_off_but_never_gives_up() -> None:
    policy = RestartPolicy(limit=2, window_s=600)
    for _ in range(20):
        policy.waited()
    assert policy.delay() == 60
    assert not policy.gave_up(1.0)


# ---- state file ------------------------------------------------------------------------------


def test_state_file_round_trip_and_a_dead_pid_reads_as_none(tmp_path: Path) -> None:
    path = tmp_path / "run" / "supervisor.json"
    state = _state(
        "restarting", reason="rank 1 on vm: gone", attempt=1, next_try_at=time.time() + 4
    )
    state.remember(Failure(at=time.time(), what="ranks", reason="rank 1 on vm: gone"))
    write_state(path, state)
    assert read_state(path) == state
    assert not list(path.parent.glob(".*"))  # the temporary file was renamed away
    write_state(path, state.model_copy(update={"pid": _exited_pid()}))
    assert read_state(path) is None


def _exited_pid() -> int:
    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


def test_state_reader_sees_changes(tmp_path: Path) -> None:
    path = tmp_path / "supervisor.json"
    reader = StateReader(path)
    assert reader.read() is None
    write_state(path, _state("running"))
    assert reader.read().phase == "running"
    time.sleep(0.01)
    write_state(path, _state("failed", reason="5 failures within 600 s"))
    assert reader.read().phase == "failed"
    path.unlink()
    assert reader.read() is None


def test_summaries_say_what_happens_next() -> None:
    now = time.time()
    restarting = _state("restarting", reason="rank 1 on vm: gone", attempt=1, next_try_at=now + 4)
    assert restarting.summary(now) == (
        "restarting the ranks (attempt 2 in 4 s) after: rank 1 on vm: gone"
    )
    failed = _state("failed", reason="5 failures within 600 s (RESTART_LIMIT=5); the last: x")
    assert "gave up restarting the ranks: 5 failures" in failed.summary(now)
    assert "./launch.sh restart tries again" in failed.summary(now)
    left = [LeftOut(rank=2, host="me@mac3", reason="not answering over SSH: timed out")]
    degraded = _state("running", left_out=left)
    assert degraded.summary(now).endswith(
        "running without rank 2 (me@mac3): not answering over SSH: timed out (DEGRADED_MODE=auto)"
    )


# ---- availability --------------------------------------------------------------------------


def test_supervised_availability() -> None:
    down = availability("down", "nothing listens on run/rank0.sock")
    ready = availability("ready", "the ranks are serving")
    assert supervised(down, None) == down
    now = supervised(down, _state("restarting", reason="rank 1 gone", attempt=1))
    assert (now.state, now.http_status, now.retry_after) == ("restarting", 503, 5)
    assert waits_for_restart(now) and not now.takes_requests
    # the supervisor has not noticed the end of the job yet: still a restart under way
    assert supervised(down, _state("running")).state == "restarting"
    failed = supervised(down, _state("failed", reason="5 failures"))
    assert (failed.state, failed.retry_after) == ("failed", 30) and not waits_for_restart(failed)
    left = [LeftOut(rank=2, host="mac3", reason="not answering")]
    degraded = supervised(ready, _state("running", left_out=left))
    assert degraded.state == "ready" and degraded.http_status == 200
    assert "without rank 2 (mac3)" in degraded.reason
    assert supervised(down, _state("stopping")) == down


def test_api_waits_for_a_restart_then_answers_503_with_the_reason(tmp_path: Path) -> None:
    state_path = tmp_path / "supervisor.json"
    write_state(state_path, _state("restarting", reason="rank 1 on vm: gone", attempt=1))
    env = {
        "SOCKET_PATH": str(tmp_path / "no-ranks.sock"),
        "RESTART_WAIT_SECONDS": "1.5",
        STATE_ENV: str(state_path),
    }
    with (
        running_api(env, tmp_path / "api.log") as api,
        httpx.Client(base_url=api.base_url, timeout=30) as http,
    ):
        health = http.get("/health")
        assert health.status_code == 503 and health.headers["Retry-After"] == "5"
        assert health.json()["status"] == "restarting"
        assert (
            "restarting the ranks (attempt 1 under way) after: rank 1 on vm: gone"
            in (health.json()["reason"])
        )
        started = time.monotonic()
        answer = http.post("/v1/chat/completions", json=CHAT)
        waited = time.monotonic() - started
        assert answer.status_code == 503 and answer.headers["Retry-After"] == "5"
        assert answer.json()["error"]["code"] == "ranks_unavailable"
        assert "restarting the ranks" in answer.json()["error"]["message"]
        assert waited >= 1.5, f"answered after {waited:.2f} s, before RESTART_WAIT_SECONDS"
        cluster = http.get("/cluster/status").json()
        assert cluster["state"] == "restarting"
        assert cluster["supervisor"]["phase"] == "restarting"
        assert cluster["supervisor"]["attempt"] == 1

        write_state(state_path, _state("failed", reason="5 failures within 600 s"))
        started = time.monotonic()
        answer = http.post("/v1/chat/completions", json=CHAT)
        assert time.monotonic() - started < 1.0  # gave up: no waiting
        assert answer.status_code == 503 and answer.headers["Retry-After"] == "30"
        assert "gave up restarting the ranks" in answer.json()["error"]["message"]
        assert http.get("/health").json()["status"] == "failed"


# ---- fit, job settings, failure reasons ------------------------------------------------------


def test_fit_check_of_a_smaller_cluster(monkeypatch: pytest.MonkeyPatch, tiny_llama: Path) -> None:
    monkeypatch.delenv("RANK_WEIGHTS", raising=False)
    settings = Settings(_env_file=None)
    plenty = 8 * 2**30
    hosts = [("rank 0", plenty, 2), ("mac2", plenty, 2)]
    assert fit_problem(tiny_llama, hosts, settings) is None
    assert fit_problem(tiny_llama, [("rank 0", plenty, 2), ("mac2", None, None)], settings) is None
    size = sum(p.stat().st_size for p in tiny_llama.glob("*.safetensors"))
    problem = fit_problem(tiny_llama, [("rank 0", plenty, 2), ("mac2", size // 4, 2)], settings)
    assert problem and "rank 1 on mac2 needs" in problem and "short by" in problem, problem
    # a draft model counts on rank 0: room for the model's KV alone is too little beside it
    # (the memory given holds the runtime's overhead too, distributed/overhead.py, which
    # the default prefix cache takes a quarter of)
    big = [RankHost(host=name, cores=2, memory_bytes=plenty) for name in ("rank 0", "mac2")]
    runtime = check_fit(tiny_llama, big, None).ranks[0].overhead_bytes
    small = [("rank 0", 4 * size + runtime * 4 // 3 + 4, 2), ("mac2", plenty, 2)]
    assert fit_problem(tiny_llama, small, settings) is None
    with_draft = Settings(_env_file=None, draft_model=str(tiny_llama))
    short = fit_problem(tiny_llama, small, with_draft)
    assert short and "tokens for each of MAX_BATCH_SIZE=8 sequences, under 256" in short, short
    monkeypatch.setenv("PARALLELISM", "pipeline")
    three = [("rank 0", plenty, 2), ("mac2", plenty, 2), ("mac3", plenty, 2)]
    refused = fit_problem(tiny_llama, three, Settings(_env_file=None))  # 2 layers, 3 ranks
    assert refused and refused.startswith("the planner refuses 3 rank(s)"), refused


def test_job_settings_without_a_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {
        "WORKER_HOSTS": "10.0.5.2,10.0.5.3",
        "WORKER_SSH": "me@mac2,ann@mac3",
        "REMOTE_DIR": "~/a,/Users/ann/b",
        "RANK_WEIGHTS": "2,1,3",
        "ENV_FILE": "/nonexistent",
    }.items():
        monkeypatch.setenv(name, value)
    settings = load_settings()
    workers = remote.configured_workers(settings)
    assert [(w.rank, w.dest, w.remote_dir) for w in workers] == [
        (1, "me@mac2", "~/a"),
        (2, "ann@mac3", "/Users/ann/b"),
    ]
    assert remote.job_settings(settings, workers) is settings
    without_first = remote.job_settings(settings, workers[1:])
    assert without_first.worker_hosts == ["10.0.5.3"]
    assert without_first.worker_ssh == ["ann@mac3"]
    assert without_first.remote_dirs == ["/Users/ann/b"]
    assert without_first.rank_weights == [2.0, 3.0]
    assert without_first.as_env()["RANK_WEIGHTS"] == "2,3"


def test_why_a_job_ended_is_read_from_its_own_part_of_the_log(tmp_path: Path) -> None:
    paths = Paths(tmp_path)
    paths.server_log.write_text("2026-01-01 10:00:00 vm r1 ERROR an old job's error\n")
    job = RankJob(load_settings(_env_file=None), {}, paths)
    job._log_offset = paths.server_log.stat().st_size
    with paths.server_log.open("a") as log:
        log.write("2026-01-01 10:01:00 vm r0 INFO ready\n")
        log.write("\x1b[33m[WARN] Node with rank 1 exited with code -9 \x1b[0m\n")
        log.write("2026-01-01 10:01:05 vm r0 ERROR rank 1 exited (its wake channel closed)\n")
    assert job.failure_reason() == (
        "rank 1 was killed by signal 9; then rank 0 on vm: rank 1 exited (its wake channel closed)"
    )
    assert job.first_error() == "rank 1 exited (its wake channel closed)"
    # no rank said why: what mlx.launch said
    paths.server_log.write_text("\x1b[33m[WARN] Node with rank 1 exited with code -9 \x1b[0m\n")
    job._log_offset = 0
    assert job.failure_reason() == "rank 1 was killed by signal 9"
    paths.server_log.write_text("")
    assert job.failure_reason() == "rank 0 closed its socket and no rank said why"


# ---- service files ---------------------------------------------------------------------------


def test_systemd_unit_runs_the_real_commands_and_verifies(tmp_path: Path) -> None:
    done = subprocess.run(
        [str(Path(".venv/bin/python").resolve()), "-m", "launcher.service", "install"]
        + ["--dir", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=Path(service.__file__).resolve().parents[1],
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    unit = (tmp_path / service.UNIT).read_text()
    root = service.ROOT
    assert f'ExecStart="{root}/launch.sh" "start" "--foreground"' in unit
    assert f'ExecStop="{root}/launch.sh" "stop"' in unit
    assert "Restart=on-failure" in unit and f"WorkingDirectory={root}" in unit
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed: the unit was written, not verified")
    assert "systemd-analyze verify: no problems" in done.stdout
    check = subprocess.run(
        ["systemd-analyze", "verify", str(tmp_path / service.UNIT)], capture_output=True, text=True
    )
    assert check.returncode == 0 and not check.stderr.strip(), check.stderr


def test_launchd_agent_runs_the_supervisor_in_the_foreground() -> None:
    agent = plistlib.loads(service.launchd_plist(Path("/Users/me/mlx ring"), "/usr/bin:/bin"))
    assert agent["Label"] == service.LABEL
    assert agent["ProgramArguments"] == ["/Users/me/mlx ring/launch.sh", "start", "--foreground"]
    assert agent["RunAtLoad"] is True and agent["KeepAlive"] == {"SuccessfulExit": False}
    assert agent["WorkingDirectory"] == "/Users/me/mlx ring"
    assert agent["EnvironmentVariables"] == {"PATH": "/usr/bin:/bin"}


# ---- a worker that does not answer ------------------------------------------------------------


def _unreachable_worker_settings(monkeypatch: pytest.MonkeyPatch, degraded: str) -> Settings:
    """One worker whose SSH destination refuses at once (nothing listens on port 1)."""
    for name, value in {
        "WORKER_HOSTS": "127.0.0.2",
        "WORKER_SSH": "ssh://root@127.0.0.1:1",
        "DEGRADED_MODE": degraded,
        "ENV_FILE": "/nonexistent",
    }.items():
        monkeypatch.setenv(name, value)
    return load_settings()


def test_a_worker_that_does_not_answer_is_waited_for(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, tiny_llama: Path
) -> None:
    settings = _unreachable_worker_settings(monkeypatch, "off")
    choice = choose_workers(settings, remote.configured_workers(settings), tiny_llama)
    active, left_out, wait = choice.active, choice.left_out, choice.wait
    assert (active, left_out) == ([], [])
    assert wait.startswith("not answering over SSH: rank 1 (ssh://root@127.0.0.1:1): "), wait
    assert "Connection refused" in wait and "waiting for it" in wait


def test_degraded_mode_leaves_out_a_worker_that_does_not_answer_when_the_model_fits(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, tiny_llama: Path
) -> None:
    settings = _unreachable_worker_settings(monkeypatch, "auto")
    workers = remote.configured_workers(settings)
    choice = choose_workers(settings, workers, tiny_llama)
    active, left_out, wait = choice.active, choice.left_out, choice.wait
    assert active == [] and wait == ""
    assert [(w.rank, w.host) for w in left_out] == [(1, "ssh://root@127.0.0.1:1")]
    assert "Connection refused" in left_out[0].reason
    # without the model's directory the fit cannot be checked: wait instead
    assert "the model directory is unknown" in choose_workers(settings, workers, None).wait


def test_mlx_launch_is_nudged_until_rank_0s_socket_is_up(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Before rank 0's socket appears the watch nudges mlx.launch once a second (the ranks'
    first probe must not share the cores with its spinning), and once more at the socket."""
    from launcher import readiness
    from launcher.start_progress import Progress

    class Job:  # what ReadyWatch asks of a RankJob, without ranks
        socket_up = False
        nudges = 0

        def socket_exists(self) -> bool:
            return self.socket_up

        def nudge(self) -> bool:
            self.nudges += 1
            return True

        def status(self) -> None:
            return None

    clock = [100.0]
    monkeypatch.setattr(readiness.time, "monotonic", lambda: clock[0])
    job = Job()
    watch = readiness.ReadyWatch(job, Progress(tmp_path / "progress", True))  # type: ignore[arg-type]
    for _ in range(10):  # 2.5 s of the supervisor's looks, 0.25 s apart
        clock[0] += 0.25
        assert watch.look() is None
    assert job.nudges == 2
    job.socket_up = True
    assert watch.look() is None and job.nudges == 3
    assert "socket is up" in (tmp_path / "progress").read_text()
