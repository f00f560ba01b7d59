"""Which workers the next job runs, in remote mode: every configured worker when all of
them answer over SSH; otherwise none (wait for them, with the reason), or with
DEGRADED_MODE=auto the ones that answer, when the model fits them (launcher/fit.py
against each host's free memory, read as launcher/detect.py does).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from config import Settings
from ipc.supervisor_state import LeftOut
from launcher import remote


@dataclass
class Choice:
    """The next job's workers, those left out, or why the supervisor must wait instead."""

    active: list[remote.Worker] = field(default_factory=list)
    left_out: list[LeftOut] = field(default_factory=list)
    wait: str = ""


def choose_workers(
    settings: Settings, workers: list[remote.Worker], model_dir: Path | None
) -> Choice:
    """Reach every worker (ending what a previous job left there) and decide."""
    if not workers:
        return Choice()
    missing = remote.reach(workers)
    if not missing:
        return Choice(active=workers)
    names = "; ".join(
        f"rank {w.rank} ({w.dest}): {missing[w.rank]}" for w in workers if w.rank in missing
    )
    lead = f"not answering over SSH: {names}"
    if settings.degraded_mode != "auto":
        return Choice(wait=f"{lead}; waiting for it (DEGRADED_MODE=auto starts without it)")
    active = [w for w in workers if w.rank not in missing]
    problem = fit_problem_without(settings, active, model_dir)
    if problem:
        return Choice(wait=f"{lead}; the model does not fit the others: {problem}")
    left_out = [
        LeftOut(rank=w.rank, host=w.dest, reason=f"not answering over SSH: {missing[w.rank]}")
        for w in workers
        if w.rank in missing
    ]
    return Choice(active=active, left_out=left_out)


def fit_problem_without(
    settings: Settings, active: list[remote.Worker], model_dir: Path | None
) -> str | None:
    """Why the model does not fit rank 0 and `active`, or None when it does."""
    from launcher.detect import local_facts, remote_facts
    from launcher.fit import fit_problem

    if model_dir is None:
        return "the model directory is unknown (start the cluster with ./launch.sh)"

    def free(worker: remote.Worker | None) -> int | None:
        if worker is None:
            return local_facts().free_bytes
        return remote_facts(worker.dest, worker.remote_dir, remote.SSH_TIMEOUT_S).free_bytes

    try:
        with ThreadPoolExecutor(max_workers=len(active) + 1) as pool:
            free_bytes = list(pool.map(free, [None, *active]))
    except (ConnectionError, ValueError, OSError) as exc:
        return f"could not read the hosts' free memory ({exc})"
    weights = remote.job_settings(settings, active).rank_weights
    if weights == "auto":
        weights = [float(b or 1) for b in free_bytes]
    return fit_problem(model_dir, free_bytes, weights, settings.parallelism)
