"""The supervisor: owns the ranks' job and api.py, and starts again whatever ends.

    python -m launcher.supervisor run [--model-dir DIR] [--foreground]   # from launch.sh
    python -m launcher.supervisor follow --pid P --timeout S             # launch.sh start
    python -m launcher.supervisor status                                 # launch.sh status

It starts the ranks (launcher/job.py), then api.py (launcher/api_process.py), each leading
its own process group, and blocks in select() on a pipe that signals wake (SIGCHLD,
SIGTERM) and on a connection to rank 0 that turns readable when rank 0 ends. A job that
ends is started again after a backoff, until a crash loop (launcher/restart_policy.py);
remote workers are reached before each start (launcher/degraded.py); api.py is started
again alone. Its state goes to run/supervisor.json (ipc/supervisor_state.py). The
decisions: docs/ARCHITECTURE.md, "Failure and supervision".
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import selectors
import signal
import sys
import time
from pathlib import Path

from config.logging_setup import setup_logging
from config.settings import Settings, run_with_settings
from distributed.group import JOIN_FAILED
from ipc.supervisor_state import Failure, SupervisorState, TransferView, print_status, write_state
from launcher import auto_split, remote
from launcher.api_process import API_READY_TIMEOUT_S, ApiKeeper, ApiProcess
from launcher.degraded import choose_workers, job_of
from launcher.job import RankJob, local_ranks_stop
from launcher.paths import Paths
from launcher.readiness import ReadyWatch
from launcher.restart_policy import Ended, RestartPolicy
from launcher.start_progress import Progress, follow
from launcher.transfer import send_model

log = logging.getLogger("ring.supervisor")

RANKS_READY_TIMEOUT_S = 900.0  # large models load slowly
END_GRACE_S = 1.0  # mlx.launch relays the ranks' last lines, then its group is killed
WATCH_TRIES = 5  # connections to rank 0 tried, 1 s apart, before its silence ends the job
# A start whose ranks could not join the group is tried again before `start` fails: a rank
# still importing on a loaded host outlives MLX's 31 s connect budget (1 in 9 CI runs).
START_JOIN_RETRIES = 2


class Supervisor:
    def __init__(
        self, settings: Settings, model_dir: Path | None, paths: Paths, foreground: bool
    ) -> None:
        self.settings = settings
        self.model_dir = model_dir
        self.paths = paths
        self.foreground = foreground
        self.environ = dict(os.environ)
        self.workers = remote.configured_workers(settings)
        self.ranks_policy = RestartPolicy(settings.restart_limit, settings.restart_window_seconds)
        self.state = SupervisorState(pid=os.getpid(), phase="starting", since=time.time())
        self.api = ApiProcess(settings, self.environ, paths)
        self.job: RankJob | None = None
        self.progress = Progress(paths.progress, enabled=not foreground)
        self.keeper = ApiKeeper(self.api, self.progress)
        self.stopping = False
        self.ever_ready = False
        self.join_retries = 0
        self._selector = selectors.DefaultSelector()
        self._wake_read, self._wake_write = os.pipe()

    # ---- the loop ----------------------------------------------------------------------

    def run(self) -> int:
        self._install_signals()
        self.paths.supervisor_pid.write_text(f"{os.getpid()}\n")
        self._publish()
        mode = "remote" if self.workers else "local"
        log.info("supervisor started (pid %d, %s mode)", os.getpid(), mode)
        try:
            while not self.stopping:
                ended = self._run_job()
                if ended is None or not self._recover(ended):
                    break
        except Exception:
            log.exception("the supervisor failed; stopping everything")
            raise
        finally:
            self._shutdown()
        return 0

    def _install_signals(self) -> None:
        for fd in (self._wake_read, self._wake_write):
            os.set_blocking(fd, False)
        signal.set_wakeup_fd(self._wake_write)
        self._selector.register(self._wake_read, selectors.EVENT_READ, "wake")
        signal.signal(signal.SIGTERM, self._on_stop)
        signal.signal(signal.SIGINT, self._on_stop)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # only to wake select()

    def _on_stop(self, signum: int, _frame: object) -> None:
        if not self.stopping:
            log.info("%s: stopping the ranks and api.py", signal.Signals(signum).name)
        self.stopping = True

    def _pump(self, timeout: float | None) -> bool:
        """Block until a signal, rank 0's watch socket, `timeout` s or api.py's next start;
        tend api.py. True when the watch socket turned readable."""
        self._tend_api()
        if self.stopping:
            return False
        if self.keeper.due is not None:
            until_api = max(0.0, self.keeper.due - time.monotonic())
            timeout = until_api if timeout is None else min(timeout, until_api)
        readable = False
        for key, _ in self._selector.select(timeout):
            if key.data == "wake":
                with contextlib.suppress(BlockingIOError):
                    os.read(self._wake_read, 512)
            else:
                readable = True
        self._tend_api()
        return readable

    # ---- the ranks ---------------------------------------------------------------------

    def _run_job(self) -> Ended | None:
        """Start the ranks and watch them: why they ended, or None when asked to stop."""
        self.state.attempt += 1
        choice = choose_workers(self.settings, self.workers, self.model_dir)
        if self.stopping:
            return None
        if choice.wait:
            return Ended(choice.wait, counts=False, before_ready=True)
        active, left_out = choice.active, choice.left_out
        settings, environ = job_of(choice, self.settings, self.environ)
        why, environ = send_model(
            settings, environ, self.model_dir, active, self._pump, lambda: self.stopping,
            self._say, self._show_transfer,
        )  # fmt: skip
        if why is not None or self.stopping:
            return Ended(why, before_ready=True) if why else None
        job = RankJob(settings, environ, self.paths)
        try:
            job.launch()
        except (OSError, ValueError) as exc:
            return Ended(f"could not start mlx.launch: {exc}", before_ready=True)
        self.job = job
        if self.ever_ready:
            self.state.restarts += 1
        self.state.world_size, self.state.left_out = job.world, left_out
        self.state.next_try_at = None
        self._publish()
        backend = settings.distributed_backend
        self.progress.say(
            f"==> Ranks: {job.world} x server.py with mlx.launch ({backend}, port {job.port})"
            f" -> {self.paths.server_log.name}"
        )
        self.progress.say(f"    mlx.launch pid {job.pid}")
        log.info("started %d rank(s): mlx.launch pid %d, port %d", job.world, job.pid, job.port)
        ended = self._wait_ready(job)
        if ended is not None or self.stopping:
            return ended
        self._ranks_ready(job)
        status = job.status()
        if status is not None:
            auto_split.record(self.paths.run, job.settings.model, status)
        return self._watch(job)

    def _wait_ready(self, job: RankJob) -> Ended | None:
        self.progress.say(f"==> Waiting for rank 0's socket ({job.socket_path})")
        deadline = time.monotonic() + RANKS_READY_TIMEOUT_S
        watch = ReadyWatch(job, self.progress)
        while not self.stopping:
            if job.ended():
                return self._finish(job, before_ready=True)
            if watch.look() is not None:
                return None
            if time.monotonic() > deadline:
                job.end(0.0)
                limit = f"{RANKS_READY_TIMEOUT_S:.0f} s"
                return Ended(f"the ranks were not ready within {limit}", before_ready=True)
            self._pump(0.25)
        return None

    def _ranks_ready(self, job: RankJob) -> None:
        self.ever_ready = True
        self.ranks_policy.came_up()
        self.state.attempt, self.state.reason = 0, ""
        self._set_phase("running")
        note = self.state.degraded_note()
        log.info("the ranks are ready (%d rank(s))%s", job.world, f"; {note}" if note else "")
        line = job.quiet(lambda seconds: self._wait_unless_ended(job, seconds))
        if line:
            self.progress.say(f"    {line}")
            log.info("%s", line)
        if self.api.process is None and self.keeper.due is None:
            self.keeper.start(first=True)
        elif not self.keeper.confirmed:
            self.keeper.confirm()  # started early, to show a model transfer
        self.progress.ready()

    def _wait_unless_ended(self, job: RankJob, seconds: float) -> None:
        """`seconds` of tending api.py, cut short by the job's end or a stop: the checks
        between ready and the watch (mlx.launch's quiet check, 2-4 s) took no notice of a
        job that ended meanwhile, and a client's stream went on for 5 s after mlx.launch
        was killed (CI, test_chaos)."""
        deadline = time.monotonic() + seconds
        while not (job.ended() or self.stopping) and (left := deadline - time.monotonic()) > 0:
            self._pump(left)

    def _watch(self, job: RankJob) -> Ended | None:
        """Block until the job ends (its reason) or a stop (None)."""
        watch = job.open_watch()
        for _ in range(WATCH_TRIES):  # a busy rank 0 may miss one handshake
            if watch is not None or job.ended() or self.stopping:
                break
            self._pump(1.0)
            watch = job.open_watch()
        if watch is not None:
            self._selector.register(watch, selectors.EVENT_READ, "watch")
        try:
            while not self.stopping:
                if job.ended() or watch is None:
                    return self._finish(job)
                if self._pump(None) and job.watch_closed():
                    return self._finish(job)
            return None
        finally:
            if watch is not None:
                self._selector.unregister(watch)

    def _finish(self, job: RankJob, before_ready: bool = False) -> Ended:
        """End what is left of the job; why it ended."""
        job.end(END_GRACE_S)
        self.job = None
        reason = job.failure_reason()
        goes_on = False
        if before_ready and not self.ever_ready:
            message = job.first_error() or reason
            goes_on = JOIN_FAILED in message and self.join_retries < START_JOIN_RETRIES
            if goes_on:
                self.join_retries += 1
                self.progress.say(f"    {message}; starting the ranks again")
            else:
                failed = f"the ranks exited during start: {message}"
                self.progress.failed(failed, self.paths.server_log)
        stopped = local_ranks_stop(self.paths)
        if stopped:
            log.info("%s", stopped)
        return Ended(reason, before_ready=before_ready, start_goes_on=goes_on)

    def _recover(self, ended: Ended) -> bool:
        """Back off and return True to start again; False when stopping or giving up."""
        now, mono = time.time(), time.monotonic()
        if ended.counts:
            self.ranks_policy.failed(mono)
            self.state.remember(Failure(at=now, what="ranks", reason=ended.reason))
        else:
            self.ranks_policy.waited()
        if not self.ever_ready and not ended.start_goes_on:
            self.progress.failed(ended.reason, self.paths.supervisor_log)  # if still open
            if self.foreground and self.api.process is None:
                self.keeper.due = mono  # so that /health can say why
        if ended.counts and self.ranks_policy.gave_up(mono):
            self._give_up(ended.reason)
            return False
        delay = self.ranks_policy.delay()
        self.state.reason, self.state.next_try_at = ended.reason, now + delay
        self._set_phase("restarting")
        log.warning(
            "the ranks ended: %s; starting them again in %.0f s (attempt %d)",
            ended.reason,
            delay,
            self.state.attempt + 1,
        )
        deadline = mono + delay
        while not self.stopping and time.monotonic() < deadline:
            self._pump(deadline - time.monotonic())
        return not self.stopping

    def _give_up(self, last: str) -> None:
        count = self.ranks_policy.recent_failures(time.monotonic())
        window = self.settings.restart_window_seconds
        self.state.reason = (
            f"{count} failures within {window:.0f} s (RESTART_LIMIT={self.settings.restart_limit})"
            f"; the last: {last}"
        )
        self.state.next_try_at = None
        self._set_phase("failed")
        log.error("gave up restarting the ranks: %s", self.state.reason)
        self._stop_workers()
        if self.api.process is None and self.keeper.due is None:
            self.keeper.due = time.monotonic()  # so that /health can say why
        while not self.stopping:
            self._pump(None)

    # ---- remote workers ------------------------------------------------------------------

    def _stop_workers(self) -> None:
        for rank, why in remote.reach(self.workers).items():
            log.warning("could not reach rank %d's host to end its rank: %s", rank, why)

    def _say(self, line: str) -> None:
        self.progress.say(line)
        log.info("%s", line.strip().removeprefix("==> "))

    def _show_transfer(self, views: list[TransferView]) -> None:
        self.state.transfer = views
        self._publish()
        # A transfer can take a while: api.py comes up now to show it (/health, dashboard).
        sending = any(view.phase == "sending" for view in views)
        if sending and self.api.process is None and self.keeper.due is None:
            self.keeper.start()

    # ---- api.py ------------------------------------------------------------------------

    def _tend_api(self) -> None:
        """Notice api.py's end and start it again after its backoff (never while stopping)."""
        failure = self.keeper.ended(self.stopping)
        if failure is not None:
            self.state.api_restarts += 1
            self.state.remember(failure)
            self._publish()
        self.keeper.start_if_due(self.stopping)

    # ---- state and stop ----------------------------------------------------------------

    def _set_phase(self, phase: str) -> None:
        self.state.phase = phase  # type: ignore[assignment]
        self.state.since = time.time()
        self._publish()

    def _publish(self) -> None:
        write_state(self.paths.state, self.state)

    def _shutdown(self) -> None:
        """End the ranks (rank 0's shutdown message first, then signals), the workers'
        leftovers and api.py; write what was stopped for launch.sh."""
        self.stopping = True
        self._set_phase("stopping")
        lines = []
        job, self.job = self.job, None
        if job is not None and job.process is not None:
            clean = job.request_shutdown(wait_s=5.0)
            forced = job.end(0.0 if clean else 5.0, signal.SIGTERM)
            how = " (signalled)" if forced else ""
            lines.append(f"stopped mlx.launch and the local ranks (process group {job.pid}){how}")
        stopped = local_ranks_stop(self.paths)
        if stopped:
            lines.append(stopped)
        self._stop_workers()
        api_pid = self.api.process.pid if self.api.process else None
        if self.api.end():
            lines.append(f"stopped api.py (process group {api_pid})")
        self.paths.stopped.write_text("".join(f"{line}\n" for line in lines))
        with contextlib.suppress(FileNotFoundError):
            if self.settings.socket_path.is_socket():
                self.settings.socket_path.unlink()
        self._set_phase("stopped")
        self.paths.supervisor_pid.unlink(missing_ok=True)
        log.info("stopped")


# ---- the command -------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launcher.supervisor")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="own the ranks and api.py until SIGTERM")
    run.add_argument("--model-dir", type=Path, default=None, help="the resolved model")
    run.add_argument("--foreground", action="store_true", help="under launchd or systemd")
    watch = sub.add_parser("follow", help="print the first start's progress (launch.sh)")
    watch.add_argument("--pid", type=int, required=True, help="the supervisor's pid")
    watch.add_argument("--timeout", type=float, default=RANKS_READY_TIMEOUT_S)
    sub.add_parser("status", help="one line: what the supervisor does now")
    args = parser.parse_args(argv)
    paths = Paths()
    if args.command == "follow":
        return follow(paths, args.pid, args.timeout + API_READY_TIMEOUT_S)
    if args.command == "status":
        return print_status(paths.state)

    def supervise(settings: Settings) -> int:
        setup_logging(settings.log_level, "supervisor")
        if args.foreground:
            with contextlib.suppress(OSError):
                os.setsid()  # lead a group of our own, as when launch.sh detaches us
        return Supervisor(settings, args.model_dir, paths, args.foreground).run()

    return run_with_settings(supervise)


if __name__ == "__main__":
    sys.exit(main())
