"""Start N ranks of server.py with mlx.launch on 127.0.0.1, for tests and benchmarks.

    with Cluster(model_dir, ranks=2, env={"MAX_BATCH_SIZE": "8"}) as cluster:
        status = cluster.status()
        with cluster.client() as client: ...

Each cluster has its own temp dir (socket, log file, empty env file), a random ring
port, and its own process group, which teardown kills if a clean stop takes too long.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ipc.client import ClientError, RankClient, get_status, wait_ready
from ipc.protocol import Shutdown
from ipc.status import Status
from launcher import cpu_layer
from launcher.command import ROOT as PROJECT_DIR
from launcher.command import Job
from launcher.hostfile import random_free_port_run


class ClusterError(Exception):
    """The ranks did not come up; the message carries the log tail."""


_BIND_FAILED = "Couldn't bind socket"  # MLX ring backend, when a rank's port is taken


class _EndedEarly(ClusterError):
    """mlx.launch ended before rank 0 was ready."""


class Cluster:
    """A local multi-rank server.py job (ring backend on 127.0.0.1)."""

    def __init__(
        self,
        model: str | Path,
        ranks: int = 2,
        env: dict[str, str] | None = None,
        workdir: Path | None = None,
        ready_timeout: float = 180.0,
    ) -> None:
        self.model = str(model)
        self.ranks = ranks
        self.extra_env = dict(env or {})
        self._tmp = None if workdir else tempfile.TemporaryDirectory(prefix="ring-cluster-")
        self.workdir = Path(workdir) if workdir else Path(self._tmp.name)  # type: ignore[union-attr]
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.socket_path = self.workdir / "rank0.sock"
        self.log_path = self.workdir / "cluster.log"
        self.ready_timeout = ready_timeout
        self.process: subprocess.Popen | None = None
        self.port = 0

    # ---- lifecycle ---------------------------------------------------------------

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            MODEL=self.model,
            SOCKET_PATH=str(self.socket_path),
            ENV_FILE=str(self.workdir / "no.env"),  # ignore the project's .env
            PREFIX_CACHE_DIR=str(self.workdir / "prefix-cache"),  # a job's own disk tier
            PYTHONUNBUFFERED="1",
        )
        env.update(self.extra_env)  # first too: the preload follows its NATIVE_KERNELS
        env.update(cpu_layer.preload(env) | cpu_layer.threads(self.ranks, env))
        env.update(self.extra_env)
        return env

    def command(self) -> list[str]:
        job = Job(program=[str(PROJECT_DIR / "server.py")], port=self.port, ranks=self.ranks)
        return job.argv()

    def start(self, attempts: int = 3) -> Status:
        """Launch and wait until rank 0 says ready; ClusterError with the log tail if not.

        A job that ends before it is ready without saying why is retried on another
        random port (another test's cluster may hold the one we drew).
        """
        for attempt in range(1, attempts + 1):
            try:
                return self._start_once()
            except _EndedEarly as exc:
                # Our ranks log ERROR for real problems (bad model, settings); no retry.
                # A port taken between our check and the ring's bind is retried.
                refused = " ERROR " in str(exc) or "error:" in str(exc)
                if attempt == attempts or (refused and _BIND_FAILED not in str(exc)):
                    raise
                self.kill()
        raise AssertionError("unreachable")

    def _start_once(self) -> Status:
        self.port = random_free_port_run(self.ranks)
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()  # a stale socket would trigger the nudge too early
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(
            self.command(),
            cwd=PROJECT_DIR,
            env=self.environment(),
            stdin=subprocess.PIPE,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + self.ready_timeout
        nudged = False
        while True:
            if not nudged and self.socket_path.exists():
                self._quiet_launcher()  # now, so it does not spin while the model loads
                nudged = True
            if self.process.poll() is not None:
                raise _EndedEarly(
                    f"mlx.launch exited with {self.process.returncode}:\n{self.log_tail()}"
                )
            try:
                status = wait_ready(self.socket_path, min(0.5, deadline - time.monotonic()))
                break
            except ClientError as exc:
                if time.monotonic() > deadline:
                    self.stop()
                    raise ClusterError(f"{exc}\n{self.log_tail()}") from None
        if not nudged:
            # A small model can bind the socket and be ready within one wait_ready call.
            self._quiet_launcher()
        return status

    def _quiet_launcher(self) -> None:
        """One byte on mlx.launch's stdin: it stops relaying stdin, which it busy-loops on.

        Only once every rank has closed its stdin: rank 0 binds its socket after the group
        handshake, which every rank enters after closing it. Our end stays open (no EOF).
        """
        assert self.process is not None and self.process.stdin is not None
        with contextlib.suppress(OSError):
            self.process.stdin.write(b"\n")
            self.process.stdin.flush()

    def stop(self, timeout: float = 10.0) -> int | None:
        """Ask rank 0 to stop every rank; kill the process group if that takes too long."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            with (
                contextlib.suppress(ClientError, OSError),
                RankClient(self.socket_path, timeout=2.0) as client,
            ):
                client.send(Shutdown())
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout)
        self.kill()
        return self.process.returncode

    def kill(self) -> None:
        """SIGKILL whatever is left of this cluster's process group."""
        if self.process is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(5)
        if self.process.stdin is not None:
            with contextlib.suppress(OSError):
                self.process.stdin.close()
        self._log.close()

    def __enter__(self) -> Cluster:
        try:
            self.start()
        except BaseException:
            self.kill()
            if self._tmp is not None:
                self._tmp.cleanup()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
        if self._tmp is not None:
            self._tmp.cleanup()

    # ---- helpers -----------------------------------------------------------------

    def client(self, timeout: float | None = 60.0) -> RankClient:
        """A new connection to rank 0 (hello already done)."""
        return RankClient(self.socket_path, timeout)

    def status(self) -> Status:
        return get_status(self.socket_path)

    def rank_pids(self) -> dict[int, int]:
        """{rank: pid} of the server.py processes (children of mlx.launch), by the MLX_RANK
        in their environment: Linux's /proc, macOS's ps (`-E` shows the environment)."""
        pids: dict[int, int] = {}
        if self.process is None:
            return pids
        if sys.platform != "linux":
            return _rank_pids_ps(self.process.pid)
        children: list[int] = []
        for task in Path(f"/proc/{self.process.pid}/task").glob("*"):
            with contextlib.suppress(OSError):
                children += map(int, (task / "children").read_text().split())
        for pid in children:
            with contextlib.suppress(OSError):
                for item in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                    if item.startswith(b"MLX_RANK="):
                        pids[int(item[9:])] = pid
        return pids

    def log_tail(self, lines: int = 40) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return ""


def _rank_pids_ps(launcher: int) -> dict[int, int]:
    """Cluster.rank_pids from BSD ps (macOS): the launcher's children, and the MLX_RANK
    that `ps -E` shows after each one's command."""
    table = subprocess.run(["ps", "-axo", "pid=,ppid="], capture_output=True, text=True)
    children = [
        int(p)
        for p, parent in (r.split() for r in table.stdout.splitlines())
        if int(parent) == launcher
    ]
    pids: dict[int, int] = {}
    for pid in children:
        shown = subprocess.run(
            ["ps", "-E", "-ww", "-o", "command=", "-p", str(pid)], capture_output=True, text=True
        )
        rank = re.search(r"\bMLX_RANK=(\d+)", shown.stdout)
        if rank:
            pids[int(rank.group(1))] = pid
    return pids
