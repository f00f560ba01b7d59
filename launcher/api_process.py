"""api.py as the supervisor's child: started in its own process group (pid in run/api.pid)
with the supervisor's state file named in its environment, ended by signal, and checked
through scripts/api_check.py (the same check launch.sh uses). ApiKeeper keeps it running:
an api.py that ends is started again after a backoff, while the ranks keep running."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time

from config.settings import Settings
from ipc.supervisor_state import STATE_ENV, Failure
from launcher.paths import Paths
from launcher.restart_policy import RestartPolicy
from launcher.start_progress import Progress

log = logging.getLogger("ring.supervisor")

API_READY_TIMEOUT_S = 60.0
API_STEADY_S = 30.0  # api.py that ran this long before it ended starts again at once


def api_url(settings: Settings) -> str:
    """Where to reach api.py from this machine (0.0.0.0 listens on 127.0.0.1 too)."""
    host = settings.api_host
    if host in ("0.0.0.0", "::"):
        host = "127.0.0.1"
    return f"http://{host}:{settings.api_port}"


class ApiProcess:
    def __init__(self, settings: Settings, environ: dict[str, str], paths: Paths) -> None:
        self.url = api_url(settings)
        self.environ = environ | {STATE_ENV: str(paths.state)}
        self.paths = paths
        self.process: subprocess.Popen[bytes] | None = None
        self.started_at = 0.0

    def start(self) -> int:
        with open(self.paths.api_log, "ab") as log:
            log.write(f"\n==== {time.strftime('%Y-%m-%d %H:%M:%S')} start\n".encode())
            log.flush()
            self.process = subprocess.Popen(
                [sys.executable, str(self.paths.root / "api.py")],
                cwd=self.paths.root,
                env=self.environ,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.started_at = time.monotonic()
        self.paths.api_pid.write_text(f"{self.process.pid}\n")
        return self.process.pid

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def exited(self) -> int | None:
        """The exit status once api.py ended by itself (None while it runs or never ran)."""
        return None if self.process is None else self.process.poll()

    def wait_healthy(self, timeout_s: float) -> str | None:
        """None once /health is ready; else why not (api_check.py's one line)."""
        assert self.process is not None
        check = [sys.executable, str(self.paths.root / "scripts" / "api_check.py"), "wait"]
        done = subprocess.run(
            [*check, self.url, "--timeout", str(timeout_s), "--pid", str(self.process.pid)],
            capture_output=True,
            text=True,
        )
        if done.returncode == 0:
            return None
        lines = done.stderr.strip().splitlines()
        return lines[-1] if lines else f"api_check.py exited with {done.returncode}"

    def end(self, timeout_s: float = 10.0) -> bool:
        """TERM its process group, KILL after `timeout_s`; True when it was running."""
        process, self.process = self.process, None
        with contextlib.suppress(FileNotFoundError):
            self.paths.api_pid.unlink()
        if process is None:
            return False
        was_running = process.poll() is None
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        return was_running


class ApiKeeper:
    """Starts api.py (the first time, waiting for /health and telling launch.sh) and starts
    it again after a backoff whenever it ends, never while the supervisor stops."""

    def __init__(self, api: ApiProcess, progress: Progress) -> None:
        self.api = api
        self.progress = progress
        self.policy = RestartPolicy(limit=2**31, window_s=1.0, first_s=0.5)
        self.due: float | None = None  # monotonic time of api.py's next start
        self.confirmed = False  # the first start's /health was seen ready (or said why not)

    def start(self, first: bool = False) -> None:
        pid = self.api.start()
        log.info("started api.py (pid %d) on %s", pid, self.api.url)
        if first:
            self.confirm()

    def confirm(self) -> None:
        """The first start's end: wait for /health and tell launch.sh."""
        self.confirmed = True
        self.progress.say(f"==> API: api.py on {self.api.url} -> {self.api.paths.api_log.name}")
        problem = self.api.wait_healthy(API_READY_TIMEOUT_S)
        if problem is None:
            self.progress.say("    /health is ready")
        else:
            self.progress.failed(problem, self.api.paths.api_log)

    def ended(self, stopping: bool) -> Failure | None:
        """api.py's end, once it ended by itself (the failure to remember); its next start
        is then due after the backoff."""
        code = self.api.exited()
        if code is None or stopping:
            return None
        mono = time.monotonic()
        if mono - self.api.started_at > API_STEADY_S:
            self.policy.came_up()
        self.policy.failed(mono)
        why = f"killed by signal {-code}" if code < 0 else f"exit status {code}"
        reason = f"api.py ended ({why})"
        self.api.end(0.0)
        delay = self.policy.delay()
        log.warning("%s; starting it again in %.1f s (the ranks keep running)", reason, delay)
        self.due = mono + delay
        return Failure(at=time.time(), what="api", reason=reason)

    def start_if_due(self, stopping: bool) -> None:
        if self.due is not None and time.monotonic() >= self.due and not stopping:
            self.due = None
            self.start()
