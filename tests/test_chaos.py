"""Chaos with local ranks: real processes killed and stopped under launch.sh's supervisor.

One cluster for the module: a project copy with 2 local ranks of a tiny model whose greedy
answers always run to max_tokens, started the way the service unit starts it (its
ExecStart, `launch.sh start --foreground`) and stopped with its ExecStop at the end. The
soak runs first, on the fresh cluster; then one fault per test, in file order.

For each fault on the ranks: a stream is in flight and the fault comes after its 5th
chunk; the stream must end with an SSE error event (never hang); a request sent right
after the fault waits for the restarted ranks (RESTART_WAIT_SECONDS) and succeeds; /health
is ready again; and exactly one supervisor, mlx.launch, api.py and two ranks run, none of
them a faulted one. The rows go to docs/RELIABILITY.md (CHAOS_REPORT=file collects them).

SOAK_SECONDS (default 12) sets the soak's length: `SOAK_SECONDS=600` is the 10-minute soak.
Resident memory grows while the ranks warm up: measured on the development VM with 32
clients, the ranks' RSS rose about 25% in the first minute (MLX's buffer cache filling
with the sizes a varying batch needs), then 1% in the next 90 s. So a soak of 2 minutes or
more holds growth after a warm-up of a fifth of its length (at least 60 s) under 5%; the
short one can only catch a gross leak: under 20% from its first quarter to its end.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from bench.loadgen import Endpoint
from ipc.processes import running
from ipc.supervisor_state import SupervisorState, read_state
from launcher.service import start_command, stop_command
from tests.support.chaos import (
    Row,
    ask,
    cluster_processes,
    health,
    report,
    restart_row,
    settled_processes,
    stream_with_fault,
    wait_ready_again,
    waited_and_succeeded,
)
from tests.support.project import Project, copy_project, setting_names
from tests.support.soak import soak

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

RUNNING = Counter({"supervisor": 1, "mlx.launch": 1, "rank": 2, "api": 1})
COLLECTIVE_TIMEOUT = 3.0
# The faults before the crash-loop test end the job 4 times; its kill is the 5th failure,
# and a failed start after it makes 6: the supervisor gives up.
RESTART_LIMIT = 6
SOAK_SECONDS = float(os.environ.get("SOAK_SECONDS", "12"))
LONG_SOAK = SOAK_SECONDS >= 120
SOAK_WARMUP_S = max(60.0, SOAK_SECONDS / 5) if LONG_SOAK else SOAK_SECONDS / 4
SOAK_GROWTH = 0.05 if LONG_SOAK else 0.20
# The prefix cache keeps finished requests' KV until its budget (by default a quarter of the
# memory): bounded small, it fills within the warm-up and then evicts, so the soak checks
# that nothing grows beyond it (about 180 of the soak's requests fit in 8 MiB).
PREFIX_CACHE = "PREFIX_CACHE_BYTES=8MiB"


@dataclass
class Chaos:
    project: Project
    service: subprocess.Popen[bytes]  # launch.sh start --foreground, become the supervisor
    model: Path
    url: str

    @property
    def root(self) -> Path:
        return self.project.root

    def state(self) -> SupervisorState:
        state = read_state(self.root / "run" / "supervisor.json")
        assert state is not None, "no supervisor state"
        return state

    def settled_state(
        self, done: Callable[[SupervisorState], bool], timeout: float = 20
    ) -> SupervisorState:
        """The supervisor's state once `done` holds, or at the deadline. api.py learns that
        the ranks are ready from rank 0 itself; the supervisor asks rank 0 in its own loop
        (every 0.25 s, each ask up to 2 s), so its phase may still read "restarting" while
        the first answers stream (a CI run on a loaded machine read it so)."""
        deadline = time.monotonic() + timeout
        state = self.state()
        while not done(state) and time.monotonic() < deadline:
            time.sleep(0.2)
            state = self.state()
        return state

    def pid(self, name: str) -> int:
        return self.project.pid(name)


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.upper() not in setting_names() | {"ENV_FILE"}}


@pytest.fixture(scope="module")
def chaos(tmp_path_factory: pytest.TempPathFactory, endless_llama: Path) -> Iterator[Chaos]:
    base = tmp_path_factory.mktemp("chaos")
    model = base / "model"  # our own copy: the crash-loop test moves it away
    shutil.copytree(endless_llama, model)
    env = (
        f"MODEL={model}\nMAX_SEQUENCE_LENGTH=4096\nDEFAULT_MAX_TOKENS=64\n"
        f"COLLECTIVE_TIMEOUT_SECONDS={COLLECTIVE_TIMEOUT}\nRESTART_WAIT_SECONDS=120\n"
        f"RESTART_LIMIT={RESTART_LIMIT}\n{PREFIX_CACHE}\n"
    )
    project = copy_project(base / "project", env)
    url = f"http://127.0.0.1:{project.port}"
    with open(base / "service.log", "ab") as log:
        service = subprocess.Popen(
            start_command(project.root),  # what the systemd unit and launchd agent run
            cwd=project.root,
            env=_clean_env(),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    cluster = Chaos(project, service, model, url)
    try:
        deadline = time.monotonic() + 600
        while health(url)[0] != 200:
            tail = (base / "service.log").read_text()[-3000:]
            assert service.poll() is None, f"the service's start exited:\n{tail}"
            assert time.monotonic() < deadline, f"not ready within 600 s:\n{tail}"
            time.sleep(0.2)
        yield cluster
    finally:
        subprocess.run(
            stop_command(project.root), env=_clean_env(), capture_output=True, timeout=120
        )
        if service.poll() is None:
            os.killpg(service.pid, signal.SIGKILL)
        service.wait(10)
        assert not cluster_processes(project.root), "processes left running after the tests"


def test_soak_32_streaming_clients(chaos: Chaos) -> None:
    """Every request finishes with usage; RSS after the warm-up grows less than 5% (a
    gross leak only, in the short soak: see the module's docstring)."""
    pids = {"api.py": chaos.pid("api.pid")}
    pids |= {f"rank {r}": chaos.pid(f"rank-{r}.pid") for r in (0, 1)}
    result = asyncio.run(soak(Endpoint(chaos.url), 32, SOAK_SECONDS, 48, pids, SOAK_WARMUP_S))
    print(
        f"\nsoak, 32 streaming clients, {SOAK_SECONDS:.0f} s, warm-up {SOAK_WARMUP_S:.0f} s:\n"
        + result.describe()
    )
    failed = [r.error for r in result.results if not (r.ok and r.prompt_tokens > 0)]
    assert not failed, f"{len(failed)} requests did not finish with usage: {failed[:3]}"
    assert all(r.completion_tokens == 48 for r in result.results)
    assert len(result.results) > 32
    memory = result.memory()
    assert set(memory) == set(pids), result.describe()
    grown = {name: growth for name, (_, _, growth) in memory.items() if growth >= SOAK_GROWTH}
    assert not grown, result.describe()
    assert cluster_processes(chaos.root) == RUNNING


# The answer in flight must outlast the fault's detection (up to 10 s is accepted): at this
# model's 14 ms a token, 600 tokens ended 4.7 s after a SIGKILL of mlx.launch in a CI run,
# before the job's end was noticed, and the stream completed instead of failing.
FAULT_STREAM_TOKENS = 3000


def _fault_on_the_ranks(
    chaos: Chaos, name: str, fault: Callable[[], None], victims: list[int]
) -> tuple[Row, SupervisorState]:
    """Stream, fault, and measure; asserts what every fault on the ranks must give."""
    restarts = chaos.state().restarts
    api = chaos.pid("api.pid")
    with ThreadPoolExecutor(1) as pool:
        end = stream_with_fault(chaos.url, fault, max_tokens=FAULT_STREAM_TOKENS)
        fault_at = time.monotonic() - end.after_fault_s
        newcomer = pool.submit(ask, chaos.url)  # sent during the restart: it waits
        ready_after = wait_ready_again(chaos.url, fault_at)
        status, waited, answer = newcomer.result()
    assert end.error_code == "ranks_unavailable", end.how
    assert status == 200, answer
    found = settled_processes(chaos.root, RUNNING)
    assert found == RUNNING, found
    assert not any(running(pid) for pid in victims), victims
    assert chaos.pid("api.pid") == api  # api.py stayed up through the restart

    def restarted(s: SupervisorState) -> bool:
        return s.phase == "running" and s.restarts == restarts + 1

    state = chaos.settled_state(restarted)
    assert restarted(state), state
    row = restart_row(name, end, ready_after, waited_and_succeeded(waited))
    report(row)
    return row, state


def _kill(pid: int, sig: signal.Signals = signal.SIGKILL) -> Callable[[], None]:
    return lambda: os.kill(pid, sig)


@pytest.mark.parametrize(
    ("rank", "name", "own_exit"),
    [
        # mlx.launch's own line (killed by signal 9) may come after the job was ended
        (1, "SIGKILL of a worker (rank 1)", "rank 1 exited"),
        (0, "SIGKILL of rank 0", "this rank exits"),
    ],
    ids=["worker", "rank_0"],
)
def test_sigkill_of_a_rank(chaos: Chaos, rank: int, name: str, own_exit: str) -> None:
    victim = chaos.pid(f"rank-{rank}.pid")
    row, state = _fault_on_the_ranks(chaos, name, _kill(victim), [victim])
    assert row.detected_s < 10
    reason = state.history[-1].reason
    assert f"rank {rank} was killed by signal 9" in reason or own_exit in reason, reason


def test_sigkill_of_mlx_launch(chaos: Chaos) -> None:
    victim = chaos.pid("ranks.pid")
    ranks = [chaos.pid("rank-0.pid"), chaos.pid("rank-1.pid")]  # orphaned: must not stay
    row, state = _fault_on_the_ranks(
        chaos, "SIGKILL of mlx.launch", _kill(victim), [victim, *ranks]
    )
    assert row.detected_s < 10
    assert state.history[-1].reason == "mlx.launch was killed by signal 9", state.history


def test_sigstop_of_a_worker_past_the_collective_timeout(chaos: Chaos) -> None:
    victim = chaos.pid("rank-1.pid")
    stop = _kill(victim, signal.SIGSTOP)
    row, state = _fault_on_the_ranks(chaos, "SIGSTOP of a worker (rank 1)", stop, [victim])
    assert COLLECTIVE_TIMEOUT - 0.5 < row.detected_s < COLLECTIVE_TIMEOUT + 10
    assert "COLLECTIVE_TIMEOUT_SECONDS" in state.history[-1].reason, state.history[-1]


def test_sigkill_of_api_py_restarts_it_alone(chaos: Chaos) -> None:
    ranks = {name: chaos.pid(name) for name in ("ranks.pid", "rank-0.pid", "rank-1.pid")}
    victim = chaos.pid("api.pid")
    end = stream_with_fault(chaos.url, _kill(victim))
    fault_at = time.monotonic() - end.after_fault_s
    assert end.how.startswith("connection dropped"), end.how
    ready_after = wait_ready_again(chaos.url, fault_at)
    status, _, answer = ask(chaos.url)
    assert status == 200, answer
    assert {name: chaos.pid(name) for name in ranks} == ranks  # the ranks were not touched
    assert chaos.pid("api.pid") != victim and not running(victim)
    assert settled_processes(chaos.root, RUNNING) == RUNNING
    state = chaos.state()
    assert state.api_restarts == 1 and state.history[-1].what == "api", state
    report(
        Row(
            fault="SIGKILL of api.py",
            client_saw="the stream's connection dropped (api.py gone)",
            detected_s=end.after_fault_s,
            ready_again_s=ready_after,
            lost="the stream in flight; new connections refused until api.py is back",
            leftovers="none (the ranks kept running)",
        )
    )


def test_a_crash_loop_gives_up_and_says_why(chaos: Chaos) -> None:
    away = chaos.model.with_name("model-moved-away")
    chaos.model.rename(away)  # every start from now on fails to load the model
    try:
        os.kill(chaos.pid("rank-1.pid"), signal.SIGKILL)
        deadline = time.monotonic() + 240
        while chaos.state().phase != "failed":
            assert time.monotonic() < deadline, chaos.state()
            time.sleep(0.5)
        state = chaos.state()
        assert state.reason.startswith(
            f"{RESTART_LIMIT} failures within 600 s (RESTART_LIMIT={RESTART_LIMIT}); the last: "
        ), state.reason
        assert "cannot load the model" in state.reason, state.reason
        code, body = health(chaos.url)
        assert code == 503 and body["status"] == "failed"
        assert "gave up restarting the ranks" in body["reason"]
        reply = httpx.post(
            f"{chaos.url}/v1/chat/completions",
            json={"model": "default", "messages": [{"role": "user", "content": "hi"}]},
            timeout=30,
        )
        assert reply.status_code == 503 and reply.headers["Retry-After"] == "30"
        cluster = httpx.get(f"{chaos.url}/cluster/status", timeout=10).json()
        assert cluster["supervisor"]["phase"] == "failed"
        assert "./launch.sh restart tries again" in cluster["supervisor"]["summary"]
        status = chaos.project.launch("status")
        assert status.returncode == 1
        assert "supervisor: gave up restarting the ranks" in status.stdout, status.stdout
        # the supervisor and api.py stay to say why; no rank, no mlx.launch
        assert settled_processes(chaos.root, Counter({"supervisor": 1, "api": 1})) == Counter(
            {"supervisor": 1, "api": 1}
        )
        print("\ncrash loop: " + json.dumps(state.summary()))
    finally:
        away.rename(chaos.model)


def test_the_units_exec_stop_ends_everything(chaos: Chaos) -> None:
    done = subprocess.run(
        stop_command(chaos.root), env=_clean_env(), capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "stopped api.py" in done.stdout
    assert chaos.service.wait(60) == 0  # the supervisor (ExecStart's process) exits cleanly
    assert not cluster_processes(chaos.root)
    assert not list((chaos.root / "run").glob("*.pid"))
