"""`./launch.sh plan`: the split of the configured model over the configured hosts and each
rank's predicted weight and KV memory against its machine, before anything loads; then
every split the model allows over 1..N of those hosts with its predicted speed (decode at
1 and 8 clients, prefill, longest context: distributed/plan_speed.py), best first, and
which one PARALLELISM=auto takes.

Local mode: NUM_DEVICES ranks on this machine, sharing its memory. Remote mode: this
machine is rank 0 and each WORKER_HOSTS entry one more rank, whose cores, memory and Apple
chip come from `launcher.detect` over SSH. `--host CHIP:MEMORY` (once per rank) plans for
Macs described by hand instead, `--link` names the link (launcher/plan_machines.py). Prints
the plan and one memory line per rank; exits 2, naming the rank and its shortfall, when the
split is refused or a rank does not fit. DRAFT_MODEL, when set, is resolved as the ranks
resolve it and counts on rank 0; one that cannot be resolved is named (rank 0 then serves
without it) and left out. A model directory with config.json alone (no weights yet) gets
the speeds, with weights counted from its shape. Remote mode also shows what each worker
receives from this host and its disk (launcher/plan_transfer.py); exit 2 when a worker is
short of disk for it.

    python -m launcher.plan_check MODEL_DIR [--host 'M4 Pro:64GB' ...] [--link jaccl]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from config.settings import Settings, run_with_settings
from distributed.hosts import RankHost, this_host
from distributed.memory import DoesNotFit, activation_bytes, check_fit
from distributed.model_shape import PlanError
from distributed.plan import resolve_weights
from distributed.plan_speed import choose, splits
from distributed.plan_speed import describe as describe_speeds
from distributed.plan_text import describe
from launcher import plan_machines
from launcher.detect import remote_facts
from launcher.hostfile import HostfileError, worker_destinations
from launcher.plan_transfer import transfer_lines


def plan_hosts(settings: Settings, timeout: float = 5.0) -> list[RankHost]:
    """One RankHost per rank, as the ranks will see themselves."""
    return hosts_and_chips(settings, timeout)[0]


def hosts_and_chips(
    settings: Settings, timeout: float = 5.0
) -> tuple[list[RankHost], list[str | None]]:
    """One RankHost per rank, and each worker's Apple chip (None: not a Mac)."""
    here = this_host()
    workers = worker_destinations(settings)
    if not workers:
        return [here] * settings.num_devices, []
    hosts, chips = [here], []
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
        chips.append(facts.chip)
    return hosts, chips


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


def check(
    settings: Settings,
    model_dir: Path,
    described: list[str] | None = None,
    link: str | None = None,
    speed: bool = True,
) -> int:
    """Print the plan, its memory and (`speed`) every split's predicted speed; the exit
    status (2: refused or does not fit)."""
    if not speed:  # `start`'s glance at the plan: memory only, no probe
        draft = draft_dir(settings)
        return _memory(settings, model_dir, plan_hosts(settings), draft, settings.parallelism)
    try:
        draft = draft_dir(settings)
        if described:
            where = plan_machines.described(described, link)
        else:
            hosts, chips = hosts_and_chips(settings)
            where = plan_machines.site(settings, model_dir, hosts, chips, link)
    except (PlanError, ValueError, RuntimeError) as exc:
        print(f"refused: {exc}", file=sys.stderr)
        return 2
    lines, fits, chosen = speeds(settings, model_dir, where)
    status = 0
    if any(model_dir.glob("*.safetensors")):  # the split auto takes, or the one asked for
        status = _memory(settings, model_dir, where.hosts, draft, chosen)
    print("\n".join(where.lines + lines))
    return status or (0 if fits else 2)


def _memory(
    settings: Settings,
    model_dir: Path,
    hosts: list[RankHost],
    draft: Path | None,
    parallelism: str,
) -> int:
    try:
        weights = resolve_weights(settings.rank_weights, hosts)
        report = check_fit(
            model_dir,
            hosts,
            weights,
            parallelism,
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


def speeds(
    settings: Settings, model_dir: Path, where: plan_machines.Site
) -> tuple[list[str], bool, str]:
    """The speed table and auto's choice; whether some split fits; the PARALLELISM the
    ranks would run (auto's choice where auto is asked)."""
    config = json.loads((model_dir / "config.json").read_text())
    activation = activation_bytes(model_dir, config)
    options = splits(
        config,
        where.hosts,
        lambda hosts: resolve_weights(settings.rank_weights, hosts),
        where.speed,
        activation,
        model_dir=model_dir,
        sequences=settings.max_batch_size,
        kv_bits=settings.kv_bits,
        prefix_setting=settings.prefix_cache_bytes,
    )
    if not options:
        return ["no split of this model is allowed on these hosts"], False, settings.parallelism
    lines = describe_speeds(options, settings.max_batch_size)
    full = [o for o in options if o.ranks == len(where.hosts)]
    chosen: str = settings.parallelism
    if len(full) > 1 and settings.parallelism == "auto":
        best, why = choose(full)
        chosen = "tensor" if best.plan.is_tensor else "pipeline"
        lines.append(f"PARALLELISM=auto on all {len(where.hosts)} rank(s): {best.name}; {why}")
    return lines, any(not o.why_not for o in options), chosen


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launcher.plan_check")
    parser.add_argument("model_dir", type=Path, help="the resolved MLX model directory")
    parser.add_argument(
        "--host",
        action="append",
        default=[],
        help="a Mac described by hand, CHIP:MEMORY (e.g. 'M4 Pro:64GB'); once per rank",
    )
    parser.add_argument(
        "--link", help="a link name (jaccl, ring-thunderbolt, ring-local) or US:GB_S"
    )
    parser.add_argument(
        "--memory-only", action="store_true", help="the plan and its memory, no speeds (start)"
    )
    args = parser.parse_args(argv)
    return run_with_settings(
        lambda settings: check(
            settings, args.model_dir, args.host, args.link, speed=not args.memory_only
        ),
        HostfileError,
    )


if __name__ == "__main__":
    raise SystemExit(main())
