"""Cutting a lazily loaded model down to one rank's part, and evaluating that part.

`split_model` is the one place that turns a whole model into a rank's share per plan (tensor
parallel, pipeline stages, or mlx-lm's own splits). The loader runs it on the model it will
serve; the memory check (distributed/memory.py) and the share builder
(distributed/rank_share.py) run it with a stand-in group for every rank, which reads only
the rank and size, so the bytes they predict or send are the very arrays a rank holds.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from distributed.pipeline import MlxLmPipeline, PipelineStage
from distributed.plan import Plan
from distributed.tensor_parallel import shard_model

Progress = Callable[[int, int], None]  # (layers loaded, layers in all)


class StandInGroup:
    """The rank and size a sharder reads while slicing; it never runs a collective."""

    def __init__(self, rank: int, size: int) -> None:
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


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


def parameters(model: nn.Module) -> list[tuple[str, mx.array]]:
    """Every parameter of `model` by its dotted name, in tree order."""
    return tree_flatten(model.parameters())  # type: ignore[return-value]


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the parameters this rank holds (its weight memory)."""
    return sum(array.nbytes for _, array in parameters(model))


def _evaluate_each(module: nn.Module) -> None:
    for _, array in parameters(module):
        mx.eval(array)


def materialize(model: nn.Module, progress: Progress | None = None) -> None:
    """Evaluate every parameter of `model`, layer by layer and tensor by tensor.

    Evaluating a slice reads its whole source tensor (a stacked expert projection can be
    gigabytes), so a rank's peak stays one source tensor above its own share.
    """
    layers = [layer for layer in getattr(model, "layers", []) if layer is not None]
    for done, layer in enumerate(layers, start=1):
        _evaluate_each(layer)
        if progress is not None:
            progress(done, len(layers))
    _evaluate_each(model)
