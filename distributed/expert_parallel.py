"""Expert parallelism: each rank holds a contiguous range of every MoE layer's routed experts.

The router stays whole on every rank, so every rank routes every token the same way. Each
rank computes only the (token, expert) pairs routed to its own experts: it evaluates the
router's choice (one sync per MoE layer), gathers those pairs, runs them and scatters the
results into the [..., k, D] slots the family's block expects (zeros elsewhere), so the
block combines scores exactly as before. Shared experts are split by columns like a dense
MLP (or kept whole on rank 0), without a reduction of their own: the block adds their
partial output to the routed one, and one all_sum per MoE layer adds the ranks' outputs.
MLX has no all_to_all and none is needed: every rank already holds every token.

Why evaluate the routing: gather_mm does the matmul of every pair it is given, so the
alternative (send other ranks' pairs to an all-zero dummy expert, no sync) costs a rank
nearly the whole model's expert compute; computing only local pairs halved a rank's MoE time
at 2 ranks (docs/ARCHITECTURE.md, "Expert parallel without all_to_all").
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from distributed.expert_load import ExpertLoad
from distributed.families.spec import DenseParts, ExpertParts
from distributed.slicing import keep_columns, keep_rows
from distributed.watchdog import EvalGuard, guarded_eval

SWITCH_PROJECTIONS = ("gate_proj", "up_proj", "down_proj", "fc1", "fc2")


class LocalExperts(nn.Module):
    """Experts [start, end) of a family's SwitchGLU, called like the whole SwitchGLU."""

    def __init__(self, experts: nn.Module, start: int, end: int) -> None:
        super().__init__()
        for name in SWITCH_PROJECTIONS:
            if hasattr(experts, name):
                keep_rows(getattr(experts, name), start, end)
        self.experts = experts
        self.start, self.count = start, end - start
        # Optional `guard(what)` context manager (a collective watchdog) around the sync.
        self.eval_guard: EvalGuard | None = None
        # rank 0: where this MoE layer (the `layer`-th) counts its routes
        self.load: ExpertLoad | None = None
        self.layer = 0

    def _routes(self, indices: mx.array) -> np.ndarray:
        guarded_eval(indices, self.eval_guard, "expert routing (all_sums before it)")
        return np.array(indices).reshape(-1).astype(np.int64)  # signed: below-range is < 0

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        k, width = indices.shape[-1], x.shape[-1]
        routes = self._routes(indices)
        if self.load is not None:
            self.load.record(self.layer, routes)
        local = routes - self.start
        pairs = np.nonzero((local >= 0) & (local < self.count))[0]
        out = mx.zeros((routes.size, width), dtype=x.dtype)
        if pairs.size:
            where = mx.array(pairs.astype(np.int32))
            tokens = x.reshape(-1, width)[where // k]
            experts = mx.array(local[pairs].astype(np.uint32))[:, None]
            out[where] = self.experts(tokens, experts)[:, 0, :].astype(x.dtype)
        return out.reshape(*indices.shape, width)


class ExpertParallelBlock(nn.Module):
    """A family's MoE block whose experts (and shared columns) are partial on this rank."""

    def __init__(self, block: nn.Module, group: mx.distributed.Group) -> None:
        super().__init__()
        self.block = block
        self.group = group

    def __call__(self, x: mx.array) -> mx.array:
        return mx.distributed.all_sum(self.block(x), group=self.group)


class NoSharedExpert(nn.Module):
    """What ranks other than 0 hold when the shared experts cannot split: nothing."""

    def __call__(self, x: mx.array) -> mx.array:
        return mx.zeros((1,), dtype=x.dtype)


def keep_mlp_columns(mlp: nn.Module, parts: DenseParts, start: int, end: int, first: bool) -> None:
    """This rank's intermediate columns of a SwiGLU MLP, output left partial (no all_sum);
    the down projection's bias stays on the first rank only."""
    keep_rows(getattr(mlp, parts.gate), start, end)
    keep_rows(getattr(mlp, parts.up), start, end)
    down = getattr(mlp, parts.down)
    bias = keep_columns(down, start, end)
    if bias is not None and first:
        down.bias = bias


def is_moe_block(block: nn.Module | None, parts: ExpertParts) -> bool:
    return block is not None and hasattr(block, parts.experts)


def shard_moe_block(
    layer: nn.Module,
    parts: ExpertParts,
    experts: tuple[int, int],
    shared: tuple[int, int],
    rank: int,
    group: mx.distributed.Group,
) -> None:
    """Keep this rank's experts and shared columns of `layer`'s MoE block; one all_sum."""
    block = getattr(layer, parts.block)
    setattr(block, parts.experts, LocalExperts(getattr(block, parts.experts), *experts))
    shared_mlp = getattr(block, parts.shared, None) if parts.shared else None
    if parts.shared and shared_mlp is not None:
        start, end = shared
        if end == start:
            setattr(block, parts.shared, NoSharedExpert())
        elif (start, end) != (0, int(shared_mlp.gate_proj.weight.shape[0])):
            keep_mlp_columns(shared_mlp, DenseParts(), start, end, rank == 0)
    setattr(layer, parts.block, ExpertParallelBlock(block, group))
