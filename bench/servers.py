"""The two servers bench.compare starts and stops: ours (launch.sh) and mlx_lm.server."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from bench.loadgen import Endpoint
from launcher import cpu_layer
from launcher.command import ROOT, VENV_BIN, Job
from launcher.hostfile import random_free_port_run

PY = VENV_BIN / "python"


def log(message: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {message}", flush=True)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class BenchRefused(RuntimeError):
    """A benchmark that cannot give meaningful figures now; the message says why."""


def load_average() -> float:
    return os.getloadavg()[0]


def wait_quiet(limit: float, patience: float) -> None:
    """Wait until the 1-minute load average is below `limit`; refuse after `patience` s."""
    deadline = time.monotonic() + patience
    while load_average() > limit:
        if time.monotonic() > deadline:
            raise BenchRefused(
                f"the 1-minute load average is {load_average():.2f} (limit {limit}): "
                "measurements on a busy machine are meaningless; retry when it is quiet "
                "or pass --max-load"
            )
        log(f"load average {load_average():.2f} > {limit}: waiting")
        time.sleep(15)


def wait_ready(endpoint: Endpoint, timeout: float, alive: Callable[[], bool]) -> float:
    """Until a 1-token chat completion succeeds; seconds waited."""
    start = time.monotonic()
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    if endpoint.model:
        body["model"] = endpoint.model
    url = endpoint.url + "/v1/chat/completions"
    last = ""
    while time.monotonic() - start < timeout:
        if not alive():
            raise RuntimeError(f"the server exited before it answered ({last})")
        try:
            response = httpx.post(url, json=body, timeout=60)
            if response.status_code == 200:
                return time.monotonic() - start
            last = f"HTTP {response.status_code}"
        except httpx.HTTPError as exc:
            last = type(exc).__name__
        time.sleep(0.5)
    raise RuntimeError(f"the server did not answer within {timeout:.0f} s ({last})")


def _pid_alive(text: str) -> bool:
    if not text.isdigit():
        return False
    try:
        os.kill(int(text), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _role(command: str) -> str:
    if "launcher.supervisor" in command:
        return "supervisor"
    if "mlx.launch" in command:
        return "mlx.launch"
    if "api.py" in command:
        return "api"
    return "ranks"


def process_cpu(groups: list[int]) -> dict[str, tuple[str, float]]:
    """{name: (role, CPU seconds)} of the live processes in these process groups (Linux
    /proc; ps elsewhere, `_process_cpu_ps`). Names: `supervisor`, `mlx.launch`, `api`,
    `rank N` (from MLX_RANK), else `pid N`; a pid is appended when a name repeats. Roles:
    supervisor, mlx.launch, api, ranks."""
    if sys.platform != "linux":
        return _process_cpu_ps(groups)
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, tuple[str, float]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) not in groups:  # fields[2] is the process group
                continue
            command = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            environ = (stat.parent / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        role = _role(command)
        rank = next((item[9:].decode() for item in environ if item.startswith(b"MLX_RANK=")), "")
        name = {"ranks": f"rank {rank}" if rank else "pid"}.get(role, role)
        if name in out or name == "pid":
            name += f" {stat.parent.name}"
        out[name] = (role, (int(fields[11]) + int(fields[12])) / tick)
    return out


def _process_cpu_ps(groups: list[int]) -> dict[str, tuple[str, float]]:
    """process_cpu from POSIX ps (macOS): the same names, but ranks are `pid N` (ps does
    not show another process's environment, where MLX_RANK is)."""
    listing = subprocess.run(
        ["ps", "-axww", "-o", "pid=,pgid=,time=,command="],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    out: dict[str, tuple[str, float]] = {}
    for row in listing.splitlines():
        pid, group, used, command = (row.split(None, 3) + [""])[:4]
        if int(group) not in groups:
            continue
        days, _, clock = used.rpartition("-")
        seconds = int(days or 0) * 86400.0
        for part in clock.split(":"):
            seconds = seconds * 60 + float(part) if part else seconds
        role = _role(command)
        name = "pid" if role == "ranks" else role
        if name in out or name == "pid":
            name += f" {pid}"
        out[name] = (role, seconds)
    return out


def launch_groups(root: Path) -> list[int]:
    """Process groups of the cluster launch.sh started from ROOT: the supervisor,
    mlx.launch (with the ranks) and api.py each lead one, and their pids are in ROOT/run."""
    groups = []
    for name in ("supervisor.pid", "ranks.pid", "api.pid"):
        path = root / "run" / name
        text = path.read_text().strip() if path.exists() else ""
        groups += [int(text)] if text.isdigit() else []
    return groups


def group_cpu(groups: list[int]) -> dict[str, float]:
    """CPU seconds (user + system) of the live processes in these process groups, summed
    by role: mlx.launch, api, ranks."""
    out: dict[str, float] = {}
    for role, seconds in process_cpu(groups).values():
        out[role] = out.get(role, 0.0) + seconds
    return out


# ---- the two servers --------------------------------------------------------------------


class Ours:
    """Our cluster through launch.sh, with settings passed as environment variables."""

    name = "ours"

    def __init__(self, ranks: int, env: dict[str, str], model_dir: Path, workdir: Path) -> None:
        self.ranks = ranks
        self.port = free_port()
        self.env = env | {
            "MODEL": str(model_dir),
            "NUM_DEVICES": str(ranks),
            "API_HOST": "127.0.0.1",
            "API_PORT": str(self.port),
            "SOCKET_PATH": str(workdir / f"ours-{ranks}.sock"),
            "API_KEY": "",
        }
        self.endpoint = Endpoint(f"http://127.0.0.1:{self.port}", "default")

    def launch(self, command: str, timeout: float) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["./launch.sh", command],
            cwd=ROOT,
            env=self.env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def start(self) -> None:
        for name in ("supervisor.pid", "ranks.pid", "api.pid"):  # one cluster per checkout
            pid_file = ROOT / "run" / name
            if pid_file.exists() and _pid_alive(pid_file.read_text().strip()):
                raise RuntimeError(
                    f"a cluster of this checkout is already running ({pid_file}): stop it "
                    "with ./launch.sh stop first"
                )
        done = self.launch("start", 900)
        if done.returncode != 0:
            self.stop()
            tail = (done.stdout + done.stderr).strip().splitlines()[-15:]
            raise RuntimeError("./launch.sh start failed:\n" + "\n".join(tail))
        wait_ready(self.endpoint, 120, lambda: True)

    def restart(self) -> None:
        """`./launch.sh restart`: the ranks and api.py again, the disk as it was."""
        done = self.launch("restart", 900)
        if done.returncode != 0:
            raise RuntimeError("./launch.sh restart failed:\n" + done.stdout[-1500:])
        wait_ready(self.endpoint, 120, lambda: True)

    def process_groups(self) -> list[int]:
        return launch_groups(ROOT)

    def stop(self) -> None:
        done = self.launch("stop", 120)
        if done.returncode != 0:
            log(f"./launch.sh stop exited {done.returncode}: {done.stderr.strip()[-300:]}")


class Peer:
    """mlx_lm.server on the same model directory: directly at 1 rank, else mlx.launch.

    quiet_launcher: the ranks' stdin is /dev/null and one byte goes to mlx.launch's stdin
    once they run, so mlx.launch stops its relay busy loop (the trick launch.sh uses for
    ours; see DESIGN.md). Without it, the peer runs as a user would start it. pipeline:
    above 1 rank, `--pipeline` (layers split over the ranks, not heads)."""

    def __init__(
        self,
        ranks: int,
        env: dict[str, str],
        model_dir: Path,
        workdir: Path,
        quiet_launcher: bool = False,
        few_rows: bool = False,
        pipeline: bool = False,
    ) -> None:
        self.quiet = quiet_launcher and ranks > 1
        self.name = "mlx_lm.server" + (" (quiet launcher)" if self.quiet else "")
        self.name += " (our few-row sgemm)" if few_rows else ""
        self.pipeline = pipeline and ranks > 1
        self.name += " (pipeline)" if self.pipeline else ""
        self.ranks = ranks
        self.port = free_port()
        # the BLAS and threads per rank that launch.sh gives our local ranks (a fair field);
        # our sgemm for a few rows (native/sgemm_rows.c) only where asked
        self.env = env | cpu_layer.preload(env, few_rows) | cpu_layer.threads(ranks, env)
        self.model_dir = model_dir
        variant = ("-quiet" if self.quiet else "") + ("-rows" if few_rows else "")
        variant += "-pipeline" if self.pipeline else ""
        self.log_path = workdir / f"peer-{ranks}{variant}-{model_dir.name}.log"
        self.process: subprocess.Popen[bytes] | None = None
        self.endpoint = Endpoint(f"http://127.0.0.1:{self.port}", "default_model")

    def command(self) -> list[str]:
        server = ["-m", "mlx_lm", "server", "--model", str(self.model_dir)]
        server += ["--port", str(self.port)] + (["--pipeline"] if self.pipeline else [])
        if self.ranks == 1:
            return [str(PY), *server]
        # quiet: each rank's stdin is /dev/null, so mlx.launch can stop relaying it
        python = ["/bin/sh", "-c", 'exec "$0" "$@" </dev/null', str(PY)] if self.quiet else None
        job = Job(program=server, port=random_free_port_run(self.ranks), ranks=self.ranks)
        blas = ("LD_PRELOAD", "OPENBLAS_NUM_THREADS", "OPENBLAS_CORETYPE")
        job.rank_env = {k: self.env[k] for k in blas if k in self.env}
        if python:
            job.python = python
        return job.argv()

    def start(self) -> None:
        with self.log_path.open("ab") as out:
            # stdin: an open pipe that never carries data, like a terminal left alone
            self.process = subprocess.Popen(
                self.command(),
                cwd=ROOT,
                env=self.env,
                stdin=subprocess.PIPE,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        try:
            wait_ready(self.endpoint, 300, self.alive)
            if self.quiet and self.process.stdin:
                self.process.stdin.write(b"\n")  # its relay's writes now fail: it stops polling
                self.process.stdin.flush()
        except RuntimeError as exc:
            self.stop()
            lines = self.log_path.read_text(errors="replace").strip().splitlines()
            died = [line.split(" - ")[-1] for line in lines if "thread died:" in line]
            errors = died or [line for line in lines if "Error" in line and "HTTP" not in line]
            raise RuntimeError(f"{exc}: {(errors or lines or [''])[0].strip()}") from None

    def process_groups(self) -> list[int]:
        return [self.process.pid] if self.process else []

    def alive(self) -> bool:
        """Running, and its generation thread has not died (it then answers 404 forever)."""
        if self.process is None or self.process.poll() is not None:
            return False
        return "generation thread died" not in self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        """TERM the whole process group (mlx.launch and its ranks), KILL after 10 s."""
        if self.process is None:
            return
        group = self.process.pid
        for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(group, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline:
                self.process.poll()
                try:
                    os.killpg(group, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.1)
            else:
                continue
            break
        if self.process.stdin:
            self.process.stdin.close()
        self.process.wait(timeout=5)
        self.process = None


def server_of(
    kind: str, ranks: int, env: dict[str, str], model: Path, workdir: Path
) -> Ours | Peer:
    """The server a bench's `--servers` names: ours, peer (mlx_lm.server; its launcher kept
    quiet at 2 ranks or more, as ours is) or peer-rows (the peer given our few-row kernel)."""
    if kind == "ours":
        return Ours(ranks, env, model, workdir)
    return Peer(ranks, env, model, workdir, ranks > 1, kind == "peer-rows")


@contextmanager
def running(server: Ours | Peer, max_load: float) -> Iterator[Ours | Peer]:
    """Start `server` once the machine is quiet; stop it however the block ends."""
    wait_quiet(max_load, 600)
    log(f"{server.name}, {server.ranks} rank(s): starting")
    server.start()
    try:
        yield server
    finally:
        server.stop()
