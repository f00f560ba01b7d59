"""One job of the ranks: hosts.json, mlx.launch in its own process group, its stdin, its
end, and why it ended (read from server.log).

mlx.launch gets the reading end of a pipe as stdin; the supervisor keeps the writing end
open (no EOF), writes one byte once rank 0's socket is up and, once the ranks are ready,
checks that mlx.launch went quiet (launcher/quiet.py). Every rank's output goes to
server.log after a `==== <time> start: N ranks` marker, so the reason a job ended is the
first ERROR line after its own marker.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import time

from config.settings import Settings
from ipc.client import ClientError, RankClient, get_status
from ipc.protocol import Shutdown
from ipc.status import Status
from launcher.auto_split import kept
from launcher.command import launch_sh_argv
from launcher.hostfile import build_hosts, free_port_run, render
from launcher.paths import Paths
from launcher.quiet import Wait, quiet_launcher, write_byte

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# our log format: `date time host role LEVEL message` (config/logging_setup.py)
_LOG_LINE = re.compile(r"^\S+ \S+ (?P<host>\S+) (?P<role>\S+) ERROR (?P<message>.*)$")
# mlx.launch's line for a rank that ended by a signal
_KILLED = re.compile(r"Node with rank (?P<rank>\d+) exited with code -(?P<signal>\d+)")


class RankJob:
    """mlx.launch running server.py on every host of `settings` (a local or remote job)."""

    def __init__(self, settings: Settings, environ: dict[str, str], paths: Paths) -> None:
        self.settings = settings
        self.environ = environ
        self.paths = paths
        self.socket_path = settings.socket_path
        self.world = 0
        self.port = 0
        self.process: subprocess.Popen[bytes] | None = None
        self._stdin_write: int | None = None
        self._log_offset = 0
        self._watch: RankClient | None = None

    # ---- start -----------------------------------------------------------------------

    def launch(self) -> None:
        """Write hosts.json and start mlx.launch; raises OSError or ValueError on failure."""
        entries = build_hosts(self.settings)
        self.paths.hosts.write_text(render(entries))
        self.world = len(entries)
        self.port = free_port_run(self.world)
        environ = self.environ | kept(self.paths.run, self.settings.model, self.world)
        argv = launch_sh_argv(self.port, environ, self.settings)
        for stale in [self.socket_path, *self.paths.run.glob("rank-*.pid")]:
            with contextlib.suppress(FileNotFoundError):
                stale.unlink()
        read_end, self._stdin_write = os.pipe()
        with open(self.paths.server_log, "ab") as log:
            stamp = time.strftime("%Y-%m-%d %H:%M:%S")
            log.write(f"\n==== {stamp} start: {self.world} ranks\n".encode())
            log.flush()
            self._log_offset = log.tell()
            self.process = subprocess.Popen(
                argv,
                cwd=self.paths.root,
                env=environ,
                stdin=read_end,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its process group holds the local ranks
            )
        os.close(read_end)
        self.paths.ranks_pid.write_text(f"{self.process.pid}\n")

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def ended(self) -> bool:
        return self.process is None or self.process.poll() is not None

    def status(self) -> Status | None:
        """Rank 0's status; None while it does not answer."""
        try:
            return get_status(self.socket_path, timeout=2.0)
        except (ClientError, OSError, ValueError):
            return None

    def socket_exists(self) -> bool:
        return self.socket_path.exists()

    def quiet(self, wait: Wait) -> str | None:
        """Stop mlx.launch's busy loop (launcher/quiet.py); the line that tells how it went.
        `wait(seconds)` passes the check's seconds (the supervisor's watches the job)."""
        if self._stdin_write is None or self.ended():
            return None
        return quiet_launcher(self.nudge, self.pid, wait)

    def nudge(self) -> bool:
        """One byte on mlx.launch's stdin, at once and unchecked (quiet() checks); False
        where it cannot be written."""
        if self._stdin_write is None or self.ended():
            return False
        return write_byte(self._stdin_write)

    # ---- running ---------------------------------------------------------------------

    def open_watch(self) -> socket.socket | None:
        """A quiet connection to rank 0 that becomes readable (EOF) when rank 0 ends."""
        try:
            self._watch = RankClient(self.socket_path, timeout=5.0)
        except (ClientError, OSError, ValueError):
            return None
        return self._watch.sock

    def watch_closed(self) -> bool:
        """After the watch socket turned readable: whether rank 0 closed it."""
        if self._watch is None:
            return True
        try:
            self._watch.sock.setblocking(False)
            return self._watch.sock.recv(1) == b""
        except BlockingIOError:
            return False
        except OSError:
            return True

    # ---- end -------------------------------------------------------------------------

    def request_shutdown(self, wait_s: float) -> bool:
        """Rank 0's shutdown message (every rank exits 0, then mlx.launch); True if it ended."""
        if self.ended():
            return True
        with (
            contextlib.suppress(ClientError, OSError, ValueError),
            RankClient(self.socket_path, timeout=2.0) as client,
        ):
            client.send(Shutdown())
            client.recv()  # returns when rank 0 closes the connection
        assert self.process is not None
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(wait_s)
        return self.ended()

    def end(self, grace_s: float, sig: int = signal.SIGKILL) -> bool:
        """Give mlx.launch `grace_s` to end by itself (it relays the ranks' last lines), then
        signal its process group: the local ranks with it. Returns whether it had to."""
        self._close_watch()
        if self.process is None:
            return False
        forced = False
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(grace_s)
        if self.process.poll() is None:
            forced = True
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, sig)  # also orphans of a killed mlx.launch
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(10)
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signal.SIGKILL)
            self.process.wait()
        if self._stdin_write is not None:
            os.close(self._stdin_write)
            self._stdin_write = None
        with contextlib.suppress(FileNotFoundError):
            self.paths.ranks_pid.unlink()
        return forced

    def _close_watch(self) -> None:
        if self._watch is not None:
            self._watch.close()
            self._watch = None

    def first_error(self) -> str | None:
        """The message of the first ERROR line this job logged (launch.sh's format)."""
        for line in self._log_lines():
            found = _LOG_LINE.match(line)
            if found:
                return found["message"]
        return None

    def failure_reason(self) -> str:
        """Why the job ended, in one line: the rank a signal killed (mlx.launch says so),
        then the first ERROR a rank logged; else how mlx.launch ended."""
        lines = self._log_lines()
        parts = []
        for line in lines:
            killed = _KILLED.search(line)
            if killed:
                parts.append(f"rank {killed['rank']} was killed by signal {killed['signal']}")
                break
        for line in lines:
            found = _LOG_LINE.match(line)
            if found:
                role = found["role"]
                who = f"rank {role[1:]}" if re.fullmatch(r"r\d+", role) else role
                parts.append(f"{who} on {found['host']}: {found['message']}")
                break
        if parts:
            return "; then ".join(parts)
        code = self.process.returncode if self.process else None
        if code is not None and code < 0:
            return f"mlx.launch was killed by signal {-code}"
        if code is not None:
            return f"mlx.launch exited with status {code} and no rank said why"
        return "rank 0 closed its socket and no rank said why"

    def _log_lines(self) -> list[str]:
        try:
            with open(self.paths.server_log, "rb") as log:
                log.seek(self._log_offset)
                text = log.read(1 << 20).decode(errors="replace")
        except OSError:
            return []
        return [_ANSI.sub("", line).strip() for line in text.splitlines() if line.strip()]


def local_ranks_stop(paths: Paths) -> str:
    """scripts/ranks.sh stop here: any rank still recorded in run/rank-*.pid."""
    done = subprocess.run(
        [str(paths.root / "scripts" / "ranks.sh"), "stop"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    return done.stdout.strip()
