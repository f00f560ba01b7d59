"""This rank's part of a lazily loaded model under a plan, and the bytes a part holds:
what the loader materializes and what the memory prediction sums from the headers alone
(distributed/memory.py), in one place."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from distributed.pipeline import MlxLmPipeline, PipelineStage
from distributed.plan import Plan
from distributed.tensor_parallel import shard_model


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the parameters this rank holds (its weight memory)."""
    arrays: list[tuple[str, mx.array]] = tree_flatten(model.parameters())  # type: ignore[assignment]
    return sum(array.nbytes for _, array in arrays)


def split_model(model: nn.Module, plan: Plan, group: mx.distributed.Group) -> nn.Module:
    """The part of lazily loaded `model` that `group`'s rank holds under `plan` (only the
    sharders and stages read the group's rank and size, so a stand-in group serves too)."""
    if plan.is_tensor:
        return shard_model(model, plan, group)
    if plan.strategy == "pipeline" and plan.via_mlx_lm:
        return MlxLmPipeline(model, plan, group)
    if plan.strategy == "pipeline":
        return PipelineStage(model, plan, group)
    return model
