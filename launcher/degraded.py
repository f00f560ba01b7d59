"""Which workers the next job runs, in remote mode: every configured worker when all of
them answer over SSH; otherwise none (wait for them, with the reason), or with
DEGRADED_MODE=auto the ones that answer, when the model fits them (the planner's
memory check, as `./launch.sh plan` runs it, against each host's free memory).
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from config.settings import Settings
from ipc.supervisor_state import LeftOut
from launcher import remote

log = logging.getLogger("ring.supervisor")


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


def job_of(
    choice: Choice, settings: Settings, environ: dict[str, str]
) -> tuple[Settings, dict[str, str]]:
    """The settings and environment of a job that runs `choice`'s workers (it logs those
    left out): their addresses and RANK_WEIGHTS entries, in rank order."""
    if choice.left_out:
        log.warning(
            "starting without %s: the model fits the other %d rank(s) (DEGRADED_MODE=auto);"
            " it is taken back at the next restart once it answers",
            ", ".join(f"rank {w.rank} ({w.host})" for w in choice.left_out),
            len(choice.active) + 1,
        )
    job = remote.job_settings(settings, choice.active)
    environ = dict(environ)
    if job is not settings:
        environ["RANK_WEIGHTS"] = job.as_env()["RANK_WEIGHTS"]
    return job, environ


def fit_problem_without(
    settings: Settings, active: list[remote.Worker], model_dir: Path | None
) -> str | None:
    """Why the model does not fit rank 0 and `active`, or None when it does."""
    from launcher.detect import HostFacts, local_facts, remote_facts

    if model_dir is None:
        return "the model directory is unknown (start the cluster with ./launch.sh)"

    def facts(worker: remote.Worker | None) -> HostFacts:
        if worker is None:
            return local_facts()
        return remote_facts(worker.dest, worker.remote_dir, remote.SSH_TIMEOUT_S)

    try:
        with ThreadPoolExecutor(max_workers=len(active) + 1) as pool:
            found = list(pool.map(facts, [None, *active]))
    except (ConnectionError, ValueError, OSError) as exc:
        return f"could not read the hosts' free memory ({exc})"
    names = ["rank 0", *(w.dest for w in active)]
    return fit_problem(
        model_dir,
        [(name, f.free_bytes, f.cores) for name, f in zip(names, found, strict=True)],
        remote.job_settings(settings, active),
    )


def fit_problem(
    model_dir: Path, hosts: list[tuple[str, int | None, int | None]], settings: Settings
) -> str | None:
    """None when the model fits ranks on `hosts` (name, free bytes, cores; rank 0 first) by
    the planner's own memory check (`./launch.sh plan`: weights plus the KV cache of
    MAX_BATCH_SIZE full sequences, and a draft model's on rank 0); else why not. Unknown
    memory is assumed to fit."""
    from distributed.hosts import RankHost
    from distributed.memory import check_fit  # imports mlx: when asked
    from distributed.model_shape import PlanError
    from distributed.plan import resolve_weights
    from launcher.plan_check import draft_dir

    rank_hosts = [
        RankHost(host=name, cores=cores or 1, memory_bytes=free or 2**62)
        for name, free, cores in hosts
    ]
    try:
        check_fit(
            model_dir,
            rank_hosts,
            resolve_weights(settings.rank_weights, rank_hosts),
            settings.parallelism,
            settings.max_batch_size,
            settings.max_sequence_length,
            settings.prefix_cache_bytes,
            settings.kv_bits,
            draft_dir(settings),
            settings.prefill_chunk_size,
        )
    except OSError as exc:
        return f"cannot read the model ({exc})"
    except PlanError as exc:
        return f"the planner refuses {len(hosts)} rank(s): {exc}"
    return None
