"""Start the real api.py as a subprocess on a free port, wait until it answers, stop it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from launcher.local_cluster import Cluster

PROJECT_DIR = Path(__file__).resolve().parents[2]


def free_port() -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class ApiProcess:
    process: subprocess.Popen
    port: int
    log_path: Path

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout: float = 10.0) -> int:
        """SIGTERM, then SIGKILL after `timeout`; returns the exit status."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        return self.process.returncode


def start_api(env: dict[str, str], log_path: Path, timeout: float = 30.0) -> ApiProcess:
    """Run `python api.py` with `env` added to a clean environment (no .env file read)."""
    port = free_port()
    full_env = {
        **os.environ,
        "ENV_FILE": str(log_path.parent / "no-such.env"),
        "API_HOST": "127.0.0.1",
        "API_PORT": str(port),
        **env,
    }
    log_file = log_path.open("ab")
    process = subprocess.Popen(
        [sys.executable, str(PROJECT_DIR / "api.py")],
        cwd=PROJECT_DIR,
        env=full_env,
        stdout=log_file,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    log_file.close()
    api = ApiProcess(process, port, log_path)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"api.py exited with {process.returncode}:\n{api.log()[-2000:]}")
        try:
            if httpx.get(f"{api.base_url}/health/live", timeout=1).status_code == 200:
                return api
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    api.stop()
    raise RuntimeError(f"api.py did not answer within {timeout} s:\n{api.log()[-2000:]}")


def wait_ready(base_url: str, timeout: float = 30.0) -> dict:
    """Poll /health until it says ready (200); its body."""
    deadline = time.monotonic() + timeout
    while True:
        response = httpx.get(f"{base_url}/health", timeout=5)
        if response.status_code == 200:
            return response.json()
        assert time.monotonic() < deadline, response.text
        time.sleep(0.1)


@contextmanager
def running_api(env: dict[str, str], log_path: Path) -> Iterator[ApiProcess]:
    api = start_api(env, log_path)
    try:
        yield api
    finally:
        api.stop()


@contextmanager
def api_over(
    cluster: Cluster, log_path: Path, env: dict[str, str] | None = None
) -> Iterator[ApiProcess]:
    """api.py in front of `cluster`'s rank 0, ready; `env`: more of its settings."""
    with running_api({"SOCKET_PATH": str(cluster.socket_path)} | (env or {}), log_path) as api:
        wait_ready(api.base_url)
        yield api


@contextmanager
def cluster_with_api(
    model: Path,
    workdir: Path,
    ranks: int = 2,
    env: dict[str, str] | None = None,
    api_env: dict[str, str] | None = None,
) -> Iterator[ApiProcess]:
    """Real ranks of `model` (settings `env`) under `workdir`, and api.py in front of them
    (settings `api_env`), ready: the API that the cluster tests talk to."""
    with (
        Cluster(model, ranks=ranks, env=env, workdir=workdir / "cluster") as cluster,
        api_over(cluster, workdir / "api.log", api_env) as api,
    ):
        yield api
