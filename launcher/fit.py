"""Whether the model fits a smaller cluster: the planner's check, then each rank's memory.

DEGRADED_MODE=auto asks it before a job without a worker that does not answer. The
planner (distributed/plan.py's make_plan) must accept the split over the remaining ranks,
and each rank's share of the weights, with HEADROOM for the KV cache and buffers, must fit
its host's free memory. The share is the rank's part of the planned split (MLP columns in
tensor parallel, layers in pipeline parallel) of the weight bytes on disk (safetensors
files hold the tensors as they load). One small function, so that a per-rank memory
prediction of the planner can replace the estimate.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from distributed.plan import Plan

HEADROOM = 1.2  # weights x this: KV cache, activations and MLX's buffers on a small batch


def weight_bytes_on_disk(model_dir: Path) -> int:
    return sum(path.stat().st_size for path in model_dir.glob("*.safetensors"))


def share_of_weights(plan: Plan, rank: int) -> float:
    """The fraction of the model's weights `rank` holds under `plan`."""
    share = plan.ranks[rank]
    if plan.is_tensor:
        start, end = share.mlp_columns
        return (end - start) / plan.shape.intermediate_size
    start, end = share.layers
    return (end - start) / plan.shape.num_layers


def fit_problem(
    model_dir: Path,
    free_bytes: list[int | None],
    weights: list[float] | None,
    parallelism: str,
) -> str | None:
    """None when the model fits ranks with `free_bytes` each (rank 0 first; None: unknown,
    assumed to fit); else why not, in one sentence."""
    from distributed.plan import PlanError, make_plan  # imports mlx: only when asked

    try:
        config = json.loads((model_dir / "config.json").read_text())
        plan = make_plan(config, len(free_bytes), weights, parallelism)
    except (OSError, ValueError) as exc:  # PlanError is a ValueError
        kind = "the planner refuses" if isinstance(exc, PlanError) else "cannot read the model"
        return f"{kind} {len(free_bytes)} rank(s): {exc}"
    total = weight_bytes_on_disk(model_dir)
    for rank, free in enumerate(free_bytes):
        need = total * share_of_weights(plan, rank) * HEADROOM
        if free is not None and need > free:
            return (
                f"rank {rank} would need about {need / 2**30:.1f} GiB of the model's "
                f"{total / 2**30:.1f} GiB, and its host has {free / 2**30:.1f} GiB free"
            )
    return None
