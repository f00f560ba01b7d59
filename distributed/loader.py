"""Load this rank's part of the model: resolve MODEL, plan the split, load lazily and slice
before anything is evaluated, so a rank only ever materializes its own share. A worker of a
remote job resolves nothing: it loads the share (or the full copy) the first host sent it
(acquisition/received.py, distributed/rank_share.py), already split."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.utils import load_model

from acquisition.received import NotReceived, Received
from acquisition.source import ModelSourceError, resolve_model, served_names
from config.settings import Settings
from distributed.expert_load import ExpertLoad
from distributed.expert_parallel import LocalExperts
from distributed.hosts import RankHost, gather_hosts
from distributed.kept_split import kept_split
from distributed.memory import activation_bytes
from distributed.model_shape import ModelShape, PlanError
from distributed.pipeline import MlxLmPipeline, PipelineStage
from distributed.plan import Plan, resolve_weights
from distributed.plan_speed import choose_plan, split_kind
from distributed.plan_text import describe
from distributed.rank_share import ShareMismatch, load_share, share_key
from distributed.speed_records import describe_speed
from distributed.splitting import Progress, materialize, split_model, weight_bytes
from distributed.step_model import Speed
from distributed.step_probe import measure_speed, steadier
from distributed.watchdog import EvalGuard

log = logging.getLogger("ring.plan")


class ModelLoadError(Exception):
    """The model cannot be resolved, planned or loaded; the message says why."""


@dataclass(frozen=True)
class ModelInfo:
    """What this rank loaded: complete once the load returns."""

    model_id: str  # the served id (acquisition.source.served_names)
    aliases: list[str]  # older names that select it
    path: Path
    config: dict
    plan: Plan
    rank: int
    weight_bytes: int
    hosts: list[RankHost]
    speed: Speed  # every rank's machine and the link, measured at start (step_probe.py)
    activation_bytes: int  # of the hidden state and the KV cache

    @property
    def host(self) -> RankHost:
        return self.hosts[self.rank]

    @property
    def ranks_on_host(self) -> int:
        return sum(1 for host in self.hosts if host.host == self.host.host)

    @property
    def share(self) -> str:
        """This rank's line of the plan."""
        return describe(self.plan)[1 + self.rank].strip()


def install_eval_guard(model: nn.Module, guard: EvalGuard) -> int:
    """Give every part of `model` that evaluates inside the forward pass (pipeline stages'
    sends and receives, expert routing) the watchdog's guard; returns how many."""
    parts = [model] + [module for _, module in model.named_modules()]
    count = 0
    for part in parts:
        if isinstance(part, PipelineStage | MlxLmPipeline | LocalExperts):
            part.eval_guard = guard
            count += 1
    return count


def install_expert_load(model: nn.Module, load: ExpertLoad) -> int:
    """Have every MoE layer of an expert split count its routes into `load` (rank 0: the
    step-time model's routing, distributed/expert_load.py); returns how many."""
    parts = [module for _, module in model.named_modules() if isinstance(module, LocalExperts)]
    for index, part in enumerate(parts):
        part.load, part.layer = load, index
    return len(parts)


def load_rank_model(
    model_dir: Path,
    group: mx.distributed.Group,
    plan: Plan,
    progress: Progress | None = None,
    share_of: str | None = None,
) -> nn.Module:
    """This rank's part of the model in `model_dir` per `plan`, evaluated, after a barrier.

    `share_of`: `model_dir` holds this rank's share of the model with that key, as the
    first host sent it (distributed/rank_share.py), already split; else the whole model.
    Called like an mlx-lm model: `model(tokens, cache=cache)` returns logits whose last
    position is correct on rank 0 (tensor parallel: every rank). All ranks call it together.
    """
    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    if ModelShape.from_config(config) != plan.shape:
        raise PlanError(f"plan was made for a different model than {model_dir}")
    if group.size() != plan.world_size:
        raise PlanError(f"plan is for {plan.world_size} ranks, the group has {group.size()}")
    lines = describe(plan)
    for line in lines if group.rank() == 0 else lines[group.rank() + 1 : group.rank() + 2]:
        log.info(line.strip())
    started = time.perf_counter()
    if share_of is not None:
        model = load_share(model_dir, plan, group, share_of, progress)
    else:
        model, _ = load_model(model_dir, lazy=True)
        model = split_model(model, plan, group)
        materialize(model, progress)
    log.info(
        "rank %d holds %.1f MiB of weights (%s), loaded in %.1f s%s",
        group.rank(),
        weight_bytes(model) / 2**20,
        plan.strategy,
        time.perf_counter() - started,
        f" from its share {model_dir.name}" if share_of is not None else "",
    )
    if group.size() > 1:
        mx.eval(mx.distributed.all_sum(mx.array([1.0]), group=group))
    return model


def _rank0s(value: int, group: mx.distributed.Group) -> int:
    """Rank 0's `value` on every rank (a collective). A worker holding a share reads no
    checkpoint headers, only the config, whose dtype an import may have changed; every
    rank must size the probe's all_sums alike."""
    if group.size() == 1:
        return value
    mine = mx.array([value if group.rank() == 0 else 0], dtype=mx.int32)
    return int(np.array(mx.distributed.all_sum(mine, group=group))[0])


def load_for_rank(
    settings: Settings, group: mx.distributed.Group, progress: Progress | None = None
) -> tuple[nn.Module, ModelInfo]:
    """This rank's part of MODEL and what it holds. Every rank calls it in lock-step;
    `progress(done, total)` follows the layers it materializes."""
    # A worker of a remote job loads what the first host sent it (acquisition/received.py);
    # rank 0, and every rank of a local job, resolves MODEL.
    held = Received.from_env(settings.model_cache_dir) if group.rank() != 0 else None
    try:
        model_dir = Path(resolve_model(settings)) if held is None else held.config_dir()
    except (ModelSourceError, NotReceived) as exc:
        raise ModelLoadError(str(exc)) from None
    config = json.loads((model_dir / "config.json").read_text())
    try:
        hosts = gather_hosts(group)
        weights = resolve_weights(settings.rank_weights, hosts)
        shape = ModelShape.from_config(config)
        activation = _rank0s(activation_bytes(model_dir, config), group)
        started = time.perf_counter()
        # before the load, for PARALLELISM=auto's choice; once more after it, for the
        # figures that last: the first can overlap a launcher still spinning on its ranks'
        # stdin (the supervisor nudges it each second until rank 0's socket is up,
        # launcher/readiness.py), which took 40% off the rate of one row's products in a
        # probe at that moment (docs/BENCHMARKS.md)
        speed = measure_speed(group, shape, activation, hosts, settings.distributed_backend)
        log.info("%s (%.2f s)", describe_speed(speed), time.perf_counter() - started)
        kept = kept_split()
        plan = choose_plan(config, weights, settings.parallelism, hosts, speed, activation, kept)
    except PlanError as exc:
        raise ModelLoadError(f"cannot split the model over {group.size()} ranks: {exc}") from None
    share_of = None
    if held is not None and held.full_copy() is None:
        share_of = held.model_key
        try:
            model_dir = held.share(share_key(held.model_key, plan, group.rank()))
        except NotReceived as exc:
            raise ModelLoadError(f"rank {group.rank()}: {exc}") from None
    try:
        model = load_rank_model(model_dir, group, plan, progress, share_of)
    except ShareMismatch as exc:
        raise ModelLoadError(f"rank {group.rank()} cannot load {model_dir}: {exc}") from None
    started, before = time.perf_counter(), speed
    speed = measure_speed(group, shape, activation, hosts, settings.distributed_backend)
    log.info("%s, after the load (%.2f s)", describe_speed(speed), time.perf_counter() - started)
    # the link's cheaper measure, before or after the load, for every figure that lasts:
    # both probes after the load read 1.2 ms a collective in one of 12 starts at 2 ranks
    # (the others 77-229 us), and it predicted its steps 105% slow (docs/BENCHMARKS.md)
    speed = replace(speed, link=steadier(before.link, speed.link))
    plan = _restart_split(plan, config, weights, hosts, speed, activation, group.rank())
    model_id, aliases = served_names(settings, model_dir)
    info = ModelInfo(
        model_id=model_id,
        aliases=aliases,
        path=model_dir,
        config=config,
        plan=plan,
        rank=group.rank(),
        weight_bytes=weight_bytes(model),
        hosts=hosts,
        speed=speed,
        activation_bytes=activation,
    )
    return model, info


def _restart_split(
    plan: Plan,
    config: dict,
    weights: list[float] | None,
    hosts: list[RankHost],
    speed: Speed,
    activation: int,
    rank: int,
) -> Plan:
    """`plan` with the split a restart keeps (PARALLELISM=auto): the one auto chooses by the
    machines measured after the load and the cheapest of the link's measures (before the
    load it read over 1 ms a collective in 3 of 58 starts here, which chose the slower
    split for the default model; after the load too, in other starts)."""
    if plan.requested != "auto" or plan.world_size < 2:
        return plan
    chosen = split_kind(plan)
    preferred = split_kind(choose_plan(config, weights, "auto", hosts, speed, activation))
    if preferred != chosen and rank == 0:
        log.warning(
            "auto: by the figures measured after the load the %s split is predicted faster "
            "than the %s split chosen before it; a restart takes it (or PARALLELISM=%s)",
            preferred,
            chosen,
            preferred,
        )
    return plan.model_copy(update={"restart_split": preferred})
