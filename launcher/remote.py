"""The worker hosts as the supervisor sees them before each start: who answers over SSH
(ending any rank a previous job left there), their free memory, and the settings of a job
that leaves some of them out (DEGRADED_MODE=auto).

Reaching a worker runs `scripts/ranks.sh stop` in its REMOTE_DIR: one SSH round trip both
proves the host answers and ends what a previous job left running there (a stopped rank,
a rank cut off by its link). Workers are reached in parallel, each within SSH_TIMEOUT_S.
"""

from __future__ import annotations

import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from config.settings import Settings
from launcher.hostfile import worker_destinations

SSH_TIMEOUT_S = 5  # ConnectTimeout; the whole command gets 15 s more (ranks.sh waits 5 s)
SSH_UNREACHABLE = 255  # ssh's own exit status when it cannot reach or log in


@dataclass(frozen=True)
class Worker:
    """One configured worker host: its rank in the full cluster and how to reach it."""

    rank: int
    address: str  # for MLX traffic (WORKER_HOSTS)
    dest: str  # SSH destination (WORKER_SSH or the address)
    remote_dir: str


def configured_workers(settings: Settings) -> list[Worker]:
    pairs = zip(worker_destinations(settings), settings.remote_dirs, strict=True)
    return [
        Worker(rank, address, dest, remote_dir)
        for rank, ((address, dest), remote_dir) in enumerate(pairs, start=1)
    ]


def _ssh(worker: Worker, command: str) -> subprocess.CompletedProcess[str]:
    argv = ["ssh", "-n", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={SSH_TIMEOUT_S}"]
    return subprocess.run(
        [*argv, worker.dest, command],
        capture_output=True,
        text=True,
        timeout=SSH_TIMEOUT_S + 15,
        stdin=subprocess.DEVNULL,
    )


def stop_ranks(worker: Worker) -> str | None:
    """End the ranks recorded on `worker`; None when it answered, else why it did not."""
    try:
        done = _ssh(worker, f"{worker.remote_dir}/scripts/ranks.sh stop")
    except subprocess.TimeoutExpired:
        return f"no answer over SSH within {SSH_TIMEOUT_S + 15} s"
    except FileNotFoundError:
        return "ssh is not installed on this machine"
    if done.returncode == SSH_UNREACHABLE:
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        return lines[-1].strip() if lines else "ssh could not connect"
    return None


def reach(workers: list[Worker]) -> dict[int, str]:
    """{rank: why} for the workers that do not answer (their leftover ranks ended on the
    others)."""
    if not workers:
        return {}
    with ThreadPoolExecutor(max_workers=len(workers)) as pool:
        answers = list(pool.map(stop_ranks, workers))
    return {w.rank: why for w, why in zip(workers, answers, strict=True) if why is not None}


def job_settings(settings: Settings, active: list[Worker]) -> Settings:
    """The settings of a job that runs only `active` of the configured workers: their
    addresses, SSH destinations, directories and RANK_WEIGHTS entries, in rank order."""
    configured = configured_workers(settings)
    if [w.rank for w in active] == [w.rank for w in configured]:
        return settings
    update: dict[str, object] = {
        "worker_hosts": [w.address for w in active],
        "worker_ssh": [w.dest for w in active] if settings.worker_ssh else [],
        "remote_dir": [w.remote_dir for w in active] or settings.remote_dir[:1],
    }
    if (
        isinstance(settings.rank_weights, list)
        and len(settings.rank_weights) == len(configured) + 1
    ):
        kept = [0, *(w.rank for w in active)]
        update["rank_weights"] = [settings.rank_weights[rank] for rank in kept]
    return settings.model_copy(update=update)
