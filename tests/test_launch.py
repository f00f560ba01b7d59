"""launch.sh end to end in local mode, in a copy of the project (its own run/, logs, port).

One start/stop cycle serves most checks; the tests run in file order against it.
"""

from __future__ import annotations

import os
import re
import socket
import time
from pathlib import Path

import pytest

from ipc.processes import running
from tests.support.first_use import mapped_kernels, traced_after_ready
from tests.support.project import (
    START_TIMEOUT,
    Project,
    copy_project,
    cpu_used,
    ours,
)
from tests.support.tiny_families import write_family_model

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

# Given to `start` in its environment: `restart` and `status` must keep it (and it keeps
# rank 0's own one-token requests out of the first-use checks)
STARTED_WITH = {"KEEP_WARM_SECONDS": "0"}
KERNELS: dict[int, set[str]] = {}  # each rank's MLX kernels once ready (tests/support/first_use)


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Project:
    root = tmp_path_factory.mktemp("launch") / "project"
    proj = copy_project(root, "MAX_SEQUENCE_LENGTH=1024\nDEFAULT_MAX_TOKENS=64\nLOG_LEVEL=DEBUG\n")
    yield proj
    proj.launch("stop", timeout=120)
    assert not ours(root), "processes left running after the tests"


def test_help_and_unknown_command(project: Project) -> None:
    done = project.launch("help")
    assert done.returncode == 0
    for command in (
        "start",
        "stop",
        "restart",
        "status",
        "test",
        "logs",
        "detect",
        "plan",
        "service",
    ):
        assert re.search(rf"^  {command} ", done.stdout, re.MULTILINE), command
    done = project.launch("frobnicate")
    assert done.returncode == 2
    assert "unknown command 'frobnicate'" in done.stderr


def test_bad_env_value_fails_at_once_with_one_line(project: Project) -> None:
    started = time.monotonic()
    done = project.launch("start", env={"NUM_DEVICES": "zero"})
    assert done.returncode == 2
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        "error: invalid setting NUM_DEVICES='zero': Input should be a valid integer, "
        "unable to parse string as an integer"
    ]
    assert time.monotonic() - started < 20
    assert not (project.root / "run" / "ranks.pid").exists()
    assert not ours(project.root)


def test_plan_shows_the_split_and_memory_and_refuses_a_rank_that_does_not_fit(
    project: Project, tmp_path: Path
) -> None:
    moe = write_family_model(tmp_path / "qwen3_moe", "qwen3_moe")
    done = project.launch("plan", env={"MODEL": str(moe), "NUM_DEVICES": "2"})
    assert done.returncode == 0, done.stderr
    # the split PARALLELISM=auto takes (the step-time model's fastest), with its memory
    auto = re.search(r"^PARALLELISM=auto on all 2 rank\(s\): 2 ranks (\S+);", done.stdout, re.M)
    assert auto, done.stdout
    shown = "tensor-even by heads + mlp columns + experts + vocabulary"
    if auto.group(1) == "pipeline":
        shown = "pipeline (asked pipeline)"
    assert f"plan {shown}" in done.stdout, done.stdout
    assert re.search(r"rank 1 on .*: weights .* \+ KV .* fits", done.stdout), done.stdout
    # every split over 1 and 2 ranks with its predicted speed, measured on this machine
    assert "predicted speed (decode at 1 and 8 clients" in done.stdout
    for split in ("1 rank", "2 ranks tensor+expert", "2 ranks pipeline"):
        assert re.search(rf"^  {re.escape(split)} +\d+\.\d t/s +\d+\.\d t/s", done.stdout, re.M), (
            split
        )
    assert (
        "measured now, as its ranks would run: 1 rank with 2 threads, 2 ranks with 1 thread each"
        in done.stdout
        or os.cpu_count() != 2
    )
    # Macs described by hand: Apple's figures, no probe; an unknown chip is named
    macs = ["--host", "M4 Pro:64GB", "--host", "M4 Pro:64GB", "--link", "jaccl"]
    done = project.launch("plan", *macs, env={"MODEL": str(moe)})
    assert done.returncode == 0, done.stderr
    assert "machines described by hand" in done.stdout and "2 ranks pipeline" in done.stdout
    done = project.launch("plan", "--host", "M9:16GB", env={"MODEL": str(moe)})
    assert done.returncode == 2
    assert "unknown chip 'M9': known Apple chips are M1, M1 Pro" in done.stderr
    short = {"MODEL": str(moe), "MAX_SEQUENCE_LENGTH": "1000000000", "MAX_BATCH_SIZE": "256"}
    done = project.launch("plan", env=short)
    assert done.returncode == 2
    assert re.search(r"refused: rank 0 on .* short by", done.stderr), done.stderr
    assert not (project.root / "run" / "ranks.pid").exists()  # nothing was started


def test_stop_with_nothing_running_succeeds(project: Project) -> None:
    done = project.launch("stop")
    assert done.returncode == 0, done.stderr
    assert "nothing was running" in done.stdout


def test_busy_api_port_fails_before_anything_starts(project: Project) -> None:
    with socket.socket() as blocker:
        blocker.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        blocker.bind(("127.0.0.1", project.port))
        blocker.listen()
        done = project.launch("start")
    assert done.returncode == 1
    assert f"127.0.0.1:{project.port} cannot be used (Address already in use)" in done.stderr
    assert "==> Ranks:" not in done.stdout
    assert not ours(project.root)


def test_failure_after_the_ranks_started_leaves_nothing_running(project: Project) -> None:
    # 4 ranks cannot split SmolLM2's 3 KV heads in tensor mode: the ranks refuse the plan
    env = {"NUM_DEVICES": "4", "PARALLELISM": "tensor"}
    done = project.launch("start", env=env, timeout=START_TIMEOUT)
    assert done.returncode == 1
    assert "==> Ranks: 4 x server.py" in done.stdout  # it got as far as the ranks
    reason = done.stderr.split("error: the ranks exited during start: ", 1)[1].splitlines()[0]
    assert "KV heads" in reason  # the ranks' own one-line refusal is the reason
    assert "last lines of" in done.stderr and "server.log" in done.stderr
    assert not ours(project.root)
    assert not list((project.root / "run").glob("*.pid"))


def _ranks(project: Project) -> dict[int, int]:
    """Each local rank's pid (run/rank-N.pid)."""
    files = (project.root / "run").glob("rank-*.pid")
    return {int(f.stem.split("-")[1]): int(f.read_text().strip()) for f in files}


def test_start_serves_and_start_again_is_a_no_op(project: Project) -> None:
    done = project.launch("start", env=STARTED_WITH, timeout=START_TIMEOUT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"Ready: http://127.0.0.1:{project.port}" in done.stdout
    # the warm-up is a step of its own, before ready (leader/warmup.py)
    assert "==> Warm-up: every rank runs rank 0's first requests" in done.stdout, done.stdout
    assert re.search(r"warmed up: \d+ requests in \d+ steps, [\d.]+ s", done.stdout)
    # and put the chat template's opening (SmolLM2's default system prompt) in the cache
    assert re.search(r"the chat template's first \d\d+ tokens cached", done.stdout), done.stdout
    KERNELS.update({rank: mapped_kernels(pid) for rank, pid in _ranks(project).items()})
    # what PARALLELISM=auto chose, for the restarts to keep (launcher/auto_split.py)
    kept = (project.root / "run" / "auto-split").read_text()
    assert re.fullmatch(r"(tensor|pipeline) 2 .*\n", kept), kept
    assert "curl http://127.0.0.1:" in done.stdout
    assert f"supervisor pid {project.pid('supervisor.pid')}" in done.stdout
    cpu = re.search(r"mlx.launch CPU: (\d+)% before the stdin byte, (\d+)% after", done.stdout)
    assert cpu and int(cpu.group(2)) < 20, done.stdout
    first = project.pid("ranks.pid")
    again = project.launch("start")
    assert again.returncode == 0
    assert "already running" in again.stdout
    assert project.pid("ranks.pid") == first


def test_status_shows_every_rank_and_health(project: Project) -> None:
    done = project.launch("status")
    assert done.returncode == 0, done.stdout
    assert "mlx.launch: running" in done.stdout
    assert re.search(r"^rank 0: running on 127\.0\.0\.1", done.stdout, re.MULTILINE)
    assert re.search(r"^rank 1: running on 127\.0\.0\.1", done.stdout, re.MULTILINE)
    assert "rank 0 socket: answering" in done.stdout
    assert re.search(r"state ready, .*2 rank\(s\), plan \S+", done.stdout), done.stdout
    assert re.search(r"^    rank 1, on .*weight 1", done.stdout, re.MULTILINE)
    assert "health: ready (HTTP 200)" in done.stdout
    assert re.search(r"settings in force .*KEEP_WARM_SECONDS=0\.0", done.stdout), done.stdout
    assert "given in the environment at start (restart keeps them): KEEP_WARM_SECONDS" in (
        done.stdout
    )


def _first_request_found_everything_ready(project: Project, kernels: dict[int, set[str]]) -> None:
    """The first request after ready: `./launch.sh test` answers, and no rank compiled a
    kernel or traced a decode shape for it (the warm-up did it all before ready)."""
    done = project.launch("test", timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.search(r"^answer: .*Paris", done.stdout, re.MULTILINE), done.stdout
    assert "perf:" in done.stdout and "completion tokens" in done.stdout
    # its prompt reused the template's opening the warm-up cached; the rest is new
    cached = re.search(r"^usage: +(\d+) prompt \((\d+) cached\)", done.stdout, re.MULTILINE)
    assert cached and 16 <= int(cached.group(2)) < int(cached.group(1)), done.stdout
    for rank, pid in _ranks(project).items():
        new = mapped_kernels(pid) - kernels[rank]
        assert not new, f"rank {rank} compiled {len(new)} kernels after ready: {sorted(new)[:3]}"
    assert not traced_after_ready(project.root / "server.log")


def test_test_command_answers_with_figures(project: Project) -> None:
    _first_request_found_everything_ready(project, KERNELS)


def test_mlx_launch_idles_without_spinning(project: Project) -> None:
    pid = project.pid("ranks.pid")
    before, started = cpu_used(pid), time.monotonic()
    time.sleep(3)
    share = (cpu_used(pid) - before) / (time.monotonic() - started)
    assert share < 0.05, f"mlx.launch used {share:.0%} of a core while idle"


def test_restart_with_an_environment_override(project: Project) -> None:
    """The settings start was given stay (KEEP_WARM_SECONDS); the one restart is given
    changes, and a line says so."""
    first = project.pid("ranks.pid")
    done = project.launch("restart", env={"NUM_DEVICES": "3"}, timeout=START_TIMEOUT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "    NUM_DEVICES: 2 -> 3\n" in done.stdout, done.stdout
    assert "KEEP_WARM_SECONDS:" not in done.stdout  # unchanged: no line
    assert "local mode: 3 ranks on 127.0.0.1" in done.stdout
    # another number of ranks: auto decides anew instead of keeping the 2-rank split
    assert "auto: kept" not in (project.root / "server.log").read_text()
    assert "Ready:" in done.stdout
    assert project.pid("ranks.pid") != first
    assert not running(first)
    status = project.launch("status")
    assert re.search(r"^rank 2: running on 127\.0\.0\.1", status.stdout, re.MULTILINE)
    # Local ranks that outnumber the cores run pipeline parallel under PARALLELISM=auto.
    oversubscribed = (os.cpu_count() or 1) < 3
    assert ("3 local ranks on" in done.stdout) == oversubscribed, done.stdout
    plan = "pipeline" if oversubscribed else "tensor"
    assert re.search(rf"3 rank\(s\), plan {plan}", status.stdout), status.stdout
    assert re.search(r"settings in force .*NUM_DEVICES=3 .*KEEP_WARM_SECONDS=0\.0", status.stdout)
    assert "at start (restart keeps them): KEEP_WARM_SECONDS, NUM_DEVICES" in status.stdout


def test_a_killed_rank_is_restarted_and_status_says_so(project: Project) -> None:
    rank1, ranks, api = (project.pid(name) for name in ("rank-1.pid", "ranks.pid", "api.pid"))
    os.kill(rank1, 9)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # the supervisor starts the ranks again by itself
        done = project.launch("status")
        if done.returncode == 0 and project.pid_or_none("rank-1.pid") not in (None, rank1):
            break
        time.sleep(0.5)
    assert done.returncode == 0, done.stdout
    assert "supervisor: running, 1 restart of the ranks, 0 of api.py; last failure" in done.stdout
    # mlx.launch reports the signal; when rank 0 sees rank 1's wake channel close first and
    # stops, its line may be the only one when the supervisor reads why (a CI run)
    named = ("(ranks): rank 1 was killed by signal 9", "rank 1 exited (its wake channel closed)")
    assert any(reason in done.stdout for reason in named), done.stdout
    assert project.pid("ranks.pid") != ranks and not running(ranks)  # a new job
    assert project.pid("api.pid") == api  # api.py stayed up
    assert "health: ready (HTTP 200)" in done.stdout
    # it kept the split PARALLELISM=auto chose before (3 ranks: restart's NUM_DEVICES)
    log = (project.root / "server.log").read_text()
    assert re.search(r"auto: kept 3 ranks (tensor|pipeline), chosen before this restart", log)
    # and its prefix cache on disk is the one the start before it used (the directory is
    # named by the split, not by the predictions of each start)
    layouts = re.findall(r"prefix cache on disk: (\S+)/rank-0", log)
    assert len(layouts) >= 3 and layouts[-1] == layouts[-2] != layouts[0], layouts
    # the restarted job warmed up before ready too
    kernels = {rank: mapped_kernels(pid) for rank, pid in _ranks(project).items()}
    _first_request_found_everything_ready(project, kernels)


def test_stop_ends_everything_and_is_idempotent(project: Project) -> None:
    api, supervisor = project.pid("api.pid"), project.pid("supervisor.pid")
    done = project.launch("stop")
    assert done.returncode == 0, done.stderr
    assert "stopped api.py" in done.stdout
    assert f"stopped the supervisor (pid {supervisor})" in done.stdout
    assert not running(api) and not running(supervisor)
    assert not ours(project.root)
    again = project.launch("stop")
    assert again.returncode == 0
    assert "nothing was running" in again.stdout
