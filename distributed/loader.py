"""Load this rank's part of a model per a Plan: lazily, sliced before anything is evaluated."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.utils import load_model

from distributed.pipeline import PipelineStage
from distributed.plan import ModelShape, Plan, PlanError
from distributed.tensor_parallel import shard_model

log = logging.getLogger("ring.plan")


def local_memory_bytes() -> int:
    """This machine's memory: the accelerator's working set where MLX reports it, else RAM."""
    info = mx.device_info()
    for key in ("max_recommended_working_set_size", "memory_size"):
        if info.get(key):
            return int(info[key])
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def gather_rank_memory(group: mx.distributed.Group) -> list[float]:
    """Every rank's memory in GiB, in rank order (a collective: all ranks must call it)."""
    mine = mx.array([local_memory_bytes() / 2**30], dtype=mx.float32)
    if group.size() == 1:
        return [float(mine[0].item())]
    return [float(x) for x in mx.distributed.all_gather(mine, group=group).tolist()]


def resolve_weights(spec: str, group: mx.distributed.Group) -> list[float] | None:
    """RANK_WEIGHTS as the planner takes it: '' -> None (equal), 'auto' -> memory, '2,1,1'."""
    spec = spec.strip()
    if not spec:
        return None
    if spec == "auto":
        return gather_rank_memory(group)
    try:
        return [float(part) for part in spec.split(",")]
    except ValueError:
        message = f"RANK_WEIGHTS={spec!r} must be empty, auto, or numbers like 2,1,1"
        raise PlanError(message) from None


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the parameters this rank holds (its weight memory)."""
    return sum(array.nbytes for _, array in tree_flatten(model.parameters()))


def _materialize(model: nn.Module) -> None:
    # Layer by layer, so a rank's peak stays near one full layer above its own share.
    for layer in getattr(model, "layers", []):
        mx.eval(layer.parameters())
    mx.eval(model.parameters())


def load_rank_model(model_dir: Path, group: mx.distributed.Group, plan: Plan) -> nn.Module:
    """This rank's part of the model in `model_dir` per `plan`, evaluated, after a barrier.

    Called like an mlx-lm model: `model(tokens, cache=cache)` returns logits whose last
    position is correct on rank 0 (tensor parallel: every rank). All ranks call it together.
    """
    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    if ModelShape.from_config(config) != plan.shape:
        raise PlanError(f"plan was made for a different model than {model_dir}")
    if group.size() != plan.world_size:
        raise PlanError(f"plan is for {plan.world_size} ranks, the group has {group.size()}")
    lines = plan.describe()
    for line in lines if group.rank() == 0 else lines[group.rank() + 1 : group.rank() + 2]:
        log.info(line.strip())
    started = time.perf_counter()
    model, _ = load_model(model_dir, lazy=True)
    if plan.is_tensor:
        model = shard_model(model, plan, group)
    elif plan.strategy == "pipeline":
        model = PipelineStage(model, plan, group)
    _materialize(model)
    log.info(
        "rank %d holds %.1f MiB of weights (%s), loaded in %.1f s",
        group.rank(),
        weight_bytes(model) / 2**20,
        plan.strategy,
        time.perf_counter() - started,
    )
    if group.size() > 1:
        mx.eval(mx.distributed.all_sum(mx.array([1.0]), group=group))
    return model
