"""`./launch.sh plan`: the split of the configured model over the configured hosts and each
rank's predicted weight and KV memory against its machine, before anything loads.

Local mode: NUM_DEVICES ranks on this machine, sharing its memory. Remote mode: this
machine is rank 0 and each WORKER_HOSTS entry one more rank, whose cores and memory come
from `launcher.detect` over SSH. Prints the plan and one memory line per rank; exits 2,
naming the rank and its shortfall, when the split is refused or a rank does not fit.
DRAFT_MODEL, when set, is resolved as the ranks resolve it and counts on rank 0; one that
cannot be resolved is named (rank 0 then serves without it) and left out. Remote mode also
shows what each worker receives from this host and its disk (launcher/plan_transfer.py);
exit 2 when a worker is short of disk for it.

    python -m launcher.plan_check MODEL_DIR
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from config.settings import Settings, run_with_settings
from distributed.hosts import RankHost, this_host
from distributed.memory import DoesNotFit, check_fit
from distributed.model_shape import PlanError
from distributed.plan import resolve_weights
from distributed.plan_text import describe
from launcher.detect import remote_facts
from launcher.hostfile import HostfileError, worker_destinations
from launcher.plan_transfer import transfer_lines


def plan_hosts(settings: Settings, timeout: float = 5.0) -> list[RankHost]:
    """One RankHost per rank, as the ranks will see themselves."""
    here = this_host()
    workers = worker_destinations(settings)
    if not workers:
        return [here] * settings.num_devices
    hosts = [here]
    for (address, dest), remote_dir in zip(workers, settings.remote_dirs, strict=True):
        try:
            facts = remote_facts(dest, remote_dir, timeout)
        except (ConnectionError, ValueError) as exc:
            raise PlanError(
                f"cannot read the memory of {dest} ({exc}); `./launch.sh detect` says what to fix"
            ) from None
        memory = facts.rank_memory_bytes or facts.total_bytes
        if not memory:
            raise PlanError(f"{dest} did not report its memory; `./launch.sh detect` checks it")
        # named as its rank names itself, so that the plan is the ranks' own
        name = facts.hostname or address
        hosts.append(RankHost(host=name, cores=facts.cores or 1, memory_bytes=memory))
    return hosts


def draft_dir(settings: Settings) -> Path | None:
    """DRAFT_MODEL's directory; None when unset or when it cannot be resolved (said why)."""
    if not settings.draft_model.strip():
        return None
    from leader.draft_model import DraftError, resolve_draft  # imports mlx: when set

    try:
        return resolve_draft(settings)
    except DraftError as exc:
        print(f"draft model left out: {exc} (rank 0 serves without it)", file=sys.stderr)
        return None


def check(settings: Settings, model_dir: Path) -> int:
    try:
        draft = draft_dir(settings)
        hosts = plan_hosts(settings)
        weights = resolve_weights(settings.rank_weights, hosts)
        report = check_fit(
            model_dir,
            hosts,
            weights,
            settings.parallelism,
            settings.max_batch_size,
            settings.max_sequence_length,
            settings.prefix_cache_bytes,
            settings.kv_bits,
            draft,
            settings.prefill_chunk_size,
        )
    except DoesNotFit as exc:
        print("\n".join(describe(exc.report.plan) + exc.report.describe()))
        print(f"refused: {exc}", file=sys.stderr)
        return 2
    except PlanError as exc:
        print(f"refused: {exc}", file=sys.stderr)
        return 2
    print("\n".join(describe(report.plan) + report.describe()))
    lines, short = transfer_lines(settings, model_dir, report.plan)
    if lines:
        print("\n".join(lines))
    if short:
        print("refused: a worker is short of disk for its part of the model", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launcher.plan_check")
    parser.add_argument("model_dir", type=Path, help="the resolved MLX model directory")
    args = parser.parse_args(argv)
    return run_with_settings(lambda settings: check(settings, args.model_dir), HostfileError)


if __name__ == "__main__":
    raise SystemExit(main())
