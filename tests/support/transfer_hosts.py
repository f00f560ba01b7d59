"""Worker hosts for the model transfer's tests and benchmark: tests/support/netns_hosts.py's
namespaces, where each worker's model cache and the directory of the test's models are
private (an empty disk of the worker's own), each REMOTE_DIR holds a copy of the project
and a hardlinked .venv (no PyPI in the namespaces), and the first host's sender
(launcher/model_sender.py) runs as the supervisor runs it, over the real SSH and the namespace
link."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from config.settings import PROJECT_DIR, Settings
from tests.support.netns_hosts import PREFIX, NetnsHosts, Worker

CACHE = Settings.model_fields["model_cache_dir"].get_default()  # each worker's own (private)


@dataclass
class Sent:
    """One sender run: its exit status and every JSON line it printed."""

    returncode: int
    events: list[dict[str, Any]] = field(default_factory=list)
    stderr: str = ""

    def last(self, kind: str) -> dict[str, Any]:
        found = [event for event in self.events if event.get("event") == kind]
        assert found, (kind, self.events, self.stderr)
        return found[-1]

    @property
    def final(self) -> dict[str, Any]:
        return self.events[-1] if self.events else {}


def copy_project(target: Path) -> None:
    """The project's files (tracked and new) and a hardlinked .venv, as a synced worker has."""
    names = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"],
        cwd=PROJECT_DIR,
        capture_output=True,
        check=True,
    ).stdout.decode()
    for name in filter(None, names.split("\0")):
        source = PROJECT_DIR / name
        if source.is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            (target / name).write_bytes(source.read_bytes())
            (target / name).chmod(source.stat().st_mode)
    venv = (PROJECT_DIR / ".venv").resolve()
    subprocess.run(["cp", "-al", str(venv), str(target / ".venv")], check=True, timeout=120)


def up(models: Path, count: int = 2) -> NetnsHosts:
    """`count` workers whose model cache and `models` are their own empty disks."""
    models.mkdir(parents=True, exist_ok=True)
    hosts = NetnsHosts(count=count, private=[CACHE, models]).up()
    try:
        for worker in hosts.workers:
            copy_project(worker.remote_dir)
    except BaseException:
        hosts.down()
        raise
    return hosts


def rank_hosts(world: int) -> str:
    """Every rank's machine as the sender's --hosts takes it (one machine per rank)."""
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return json.dumps([{"host": f"h{r}", "cores": 2, "memory_bytes": memory} for r in range(world)])


def sender(
    hosts: NetnsHosts,
    worker: Worker,
    model_dir: Path,
    world: int,
    env: dict[str, str],
    rank: int | None = None,
) -> subprocess.Popen[str]:
    """The sender of `worker`'s part (its rank: the worker's number unless given)."""
    argv = [
        sys.executable, "-m", "launcher.model_sender", "--model-dir", str(model_dir),
        "--rank", str(rank or worker.index), "--hosts", rank_hosts(world),
        "--dest", f"root@{worker.address}", "--remote-dir", str(worker.remote_dir),
        "--address", worker.address, "--streams", env.get("TRANSFER_STREAMS", "4"),
    ]  # fmt: skip
    clean = {k: v for k, v in os.environ.items() if k.upper() not in _setting_names()}
    return subprocess.Popen(
        argv,
        cwd=PROJECT_DIR,
        env=clean | {"PATH": f"{hosts.bin}:{os.environ['PATH']}"} | env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def _setting_names() -> set[str]:
    return {name.upper() for name in Settings.model_fields} | {"MODEL_REPO", "ENV_FILE"}


def follow(
    process: subprocess.Popen[str], on_event: Callable[[dict[str, Any]], bool] | None = None
) -> Sent:
    """Read the sender's lines until it ends; `on_event` returning True ends it (SIGTERM to
    its process group, as the supervisor's stop does)."""
    assert process.stdout is not None and process.stderr is not None
    sent = Sent(returncode=0)
    errors: list[str] = []
    reader = threading.Thread(target=lambda: errors.append(process.stderr.read()), daemon=True)
    reader.start()
    for line in process.stdout:
        try:
            event = json.loads(line)
        except ValueError:
            continue
        sent.events.append(event)
        if on_event is not None and on_event(event):
            os.killpg(process.pid, signal.SIGTERM)
            break
    sent.returncode = process.wait(timeout=300)
    reader.join(10)
    sent.stderr = "".join(errors)
    return sent


def send(
    hosts: NetnsHosts,
    workers: list[Worker],
    model_dir: Path,
    world: int,
    env: dict[str, str],
    rank: int | None = None,
) -> list[Sent]:
    """The senders of one start, one per worker, at once (as the supervisor runs them);
    `rank` for a single worker that is not rank `worker.index` in this job."""
    with ThreadPoolExecutor(len(workers)) as pool:
        runs = [pool.submit(follow, sender(hosts, w, model_dir, world, env, rank)) for w in workers]
        return [run.result() for run in runs]


def files_on(hosts: NetnsHosts, worker: Worker, path: Path) -> dict[str, int]:
    """Every file below `path` on the worker's own disk, with its size."""
    done = hosts.run_in(worker, "find", str(path), "-type", "f", "-printf", "%P %s\n")
    sizes = [line.rsplit(" ", 1) for line in done.stdout.splitlines()]
    return {name: int(size) for name, size in sizes}


def fetch(hosts: NetnsHosts, worker: Worker, path: Path, into: Path) -> Path:
    """A copy of a directory on the worker's private disk, where this machine can read it."""
    into.mkdir(parents=True, exist_ok=True)
    done = hosts.run_in(worker, "cp", "-a", str(path), str(into))
    assert done.returncode == 0, done.stderr
    return into / path.name


def limit_link(worker: Worker, rate: str | None) -> None:
    """Shape what reaches the worker to `rate` (tc tbf on its veth), or lift it (None)."""
    device = f"{PREFIX}-v{worker.index}"
    subprocess.run(["tc", "qdisc", "del", "dev", device, "root"], capture_output=True)
    if rate is not None:
        subprocess.run(
            ["tc", "qdisc", "add", "dev", device, "root", "tbf", "rate", rate, "burst", "64kb",
             "latency", "400ms"],
            check=True,
            capture_output=True,
        )  # fmt: skip


def wait_for(condition: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)
