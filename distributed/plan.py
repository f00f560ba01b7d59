"""Split planner: which heads, experts, MLP columns, vocabulary rows and layers each rank holds.

`make_plan` reads only the model config (through the family registry), so a split that
cannot be honoured is refused (with the reason and the alternatives that would work) before
any weight loads. Tensor plans split attention by whole KV-head groups, dense MLPs by
columns, MoE layers by whole experts and the embeddings and head by vocabulary rows; the
fine units (columns, rows) are weighed so that every rank's whole share follows its weight
(distributed/shares.py). Pipeline plans give each rank a contiguous range of layers.

Elsewhere: a plan's text for logs and the CLI (distributed/plan_text.py), the memory check
(distributed/memory.py `check_fit`), the CLI (`python -m distributed.plan_cli`).
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel

from config.settings import Parallelism, RankWeights
from distributed.families import registered
from distributed.hosts import RankHost, crowded_host
from distributed.model_shape import ModelShape, PlanError
from distributed.shares import Span, apportion, balance, spans, split
from distributed.split_checks import (
    Context,
    alternatives,
    column_problems,
    head_problems,
    is_even,
    pipeline_problems,
    refuse,
    tensor_problems,
    unregistered,
)

Strategy = Literal["single", "tensor-even", "tensor-uneven", "pipeline"]


class RankShare(BaseModel):
    """One rank's part. Ranges are [start, end) in units of heads, experts, columns,
    vocabulary rows or layers; (0, 0) where the rank holds none."""

    rank: int
    weight: float
    kv_heads: Span
    q_heads: Span
    mlp_columns: Span
    layers: Span
    embeddings: bool
    head: bool
    experts: Span = (0, 0)
    shared_columns: Span = (0, 0)
    vocab: Span = (0, 0)


class Plan(BaseModel):
    """The whole split; `model_dump()` is what /cluster/status shows."""

    strategy: Strategy
    requested: Parallelism
    world_size: int
    weights: list[float]
    shape: ModelShape
    ranks: list[RankShare]
    split_heads: bool = False  # tensor: attention by heads (else whole on every rank)
    split_experts: bool = False  # tensor: MoE layers by expert
    split_vocab: bool = False  # tensor: embeddings and head by vocabulary rows
    via_mlx_lm: bool = False  # through mlx-lm's own Model.shard() or model.pipeline()
    note: str = ""  # why auto chose this strategy, or what stays whole
    # auto: the kind of split a restart keeps, chosen by the figures measured after the load
    # (distributed/loader.py; launcher/auto_split.py)
    restart_split: str = ""

    @property
    def is_tensor(self) -> bool:
        return self.strategy in ("tensor-even", "tensor-uneven")

    def identity(self) -> dict[str, Any]:
        """The parts that decide what any rank holds and computes: not the weights that led
        to the spans, nor why it was chosen (the note: auto's predictions, which differ at
        every start), nor what was asked or what a restart keeps. What names a rank's share
        of the weights and the prefix cache's entries on disk."""
        dump = self.model_dump(exclude={"weights", "note", "requested", "restart_split"})
        for share in dump["ranks"]:
            share.pop("weight", None)
        return dump


def _check_weights(world_size: int, weights: list[float] | None) -> list[float]:
    if weights is None:
        return [1.0] * world_size
    weights = [float(w) for w in weights]
    if len(weights) != world_size:
        raise PlanError(
            f"{len(weights)} rank weights given for {world_size} ranks; give exactly one "
            f"positive weight per rank (e.g. RANK_WEIGHTS={','.join(['1'] * world_size)}) "
            "or none for equal shares"
        )
    if not all(math.isfinite(w) and w > 0 for w in weights):
        raise PlanError(f"rank weights {weights} must all be positive numbers, e.g. 2,1,1")
    return weights


def resolve_weights(spec: RankWeights, hosts: list[RankHost]) -> list[float] | None:
    """RANK_WEIGHTS as the planner takes it: None (equal), by memory for `auto`, or as given."""
    if spec == "auto":
        return [host.memory_bytes / 2**30 for host in hosts]
    return spec


# ---- plans ------------------------------------------------------------------------------


def make_plan(
    config: dict,
    world_size: int,
    weights: list[float] | None,
    parallelism: str = "auto",
    hosts: list[RankHost] | None = None,
) -> Plan:
    """Plan the split of `config`'s model over `world_size` ranks, or raise PlanError.

    `hosts` (one per rank) lets `auto` see ranks that share a machine's cores.
    """
    if world_size < 1:
        raise PlanError(f"world size {world_size} must be at least 1")
    if parallelism not in ("auto", "tensor", "pipeline"):
        raise PlanError(f"PARALLELISM={parallelism!r} must be one of auto, tensor, pipeline")
    weights = _check_weights(world_size, weights)
    shape = ModelShape.from_config(config)
    if world_size == 1:
        return _single_plan(shape, weights, parallelism)
    family = registered(shape.model_type)
    if family is None:
        raise unregistered(shape.model_type)
    ctx = Context(shape, family, config)
    tensor_refusal = tensor_problems(shape, family, config, world_size, weights)
    pipeline_refusal = pipeline_problems(shape, family, world_size)
    if parallelism == "tensor" and tensor_refusal:
        raise refuse(tensor_refusal, alternatives(ctx, world_size, weights, "tensor"))
    if parallelism == "pipeline" and pipeline_refusal:
        raise refuse(pipeline_refusal, alternatives(ctx, world_size, weights, "pipeline"))
    if parallelism == "auto" and tensor_refusal and pipeline_refusal:
        raise refuse(
            tensor_refusal + pipeline_refusal, alternatives(ctx, world_size, weights, "both")
        )
    use_tensor = parallelism == "tensor" or (parallelism == "auto" and not tensor_refusal)
    crowded = crowded_host(hosts) if hosts and parallelism == "auto" else None
    if use_tensor and crowded and not pipeline_refusal:
        # Ranks that take turns on the cores wait for each other twice a layer in tensor
        # parallel: with more local ranks than cores a decode step took several times as
        # long as pipeline parallel (docs/BENCHMARKS.md, "Figures behind the code").
        name, count, cores = crowded
        plan = _pipeline_plan(shape, world_size, weights, parallelism, family.mlx_lm_pipeline)
        plan.note = (
            f"{count} local ranks on {cores} cores of {name}: pipeline parallel "
            "(PARALLELISM=tensor to override)"
        )
        return plan
    if use_tensor:
        if family.via_mlx_lm:
            return _mlx_lm_plan(shape, world_size, weights, parallelism)
        return _tensor_plan(shape, world_size, weights, parallelism)
    return _pipeline_plan(shape, world_size, weights, parallelism, family.mlx_lm_pipeline)


def _plan(
    strategy: Strategy,
    asked: str,
    shape: ModelShape,
    weights: list[float],
    ranks: list[RankShare],
    **details: Any,
) -> Plan:
    """What every strategy's plan states: one weight and one share per rank (the weights'
    count is the world size: _check_weights made it so); `details`: the tensor plans'
    split_*, via_mlx_lm and note."""
    return Plan(
        strategy=strategy,
        requested=asked,
        world_size=len(weights),
        weights=weights,
        shape=shape,
        ranks=ranks,
        **details,
    )


def _whole(shape: ModelShape, rank: int, weight: float, layers: Span, first: bool, head: bool):
    return RankShare(
        rank=rank,
        weight=weight,
        kv_heads=(0, shape.num_kv_heads),
        q_heads=(0, shape.num_heads),
        mlp_columns=(0, shape.intermediate_size),
        layers=layers,
        embeddings=first,
        head=head,
        experts=(0, shape.num_experts),
        shared_columns=(0, shape.shared_size),
        vocab=(0, shape.vocab_size) if first or head else (0, 0),
    )


def _single_plan(shape: ModelShape, weights: list[float], asked: str) -> Plan:
    share = _whole(shape, 0, weights[0], (0, shape.num_layers), True, True)
    return _plan("single", asked, shape, weights, [share])


def _mlx_lm_plan(shape: ModelShape, world: int, weights: list[float], asked: str) -> Plan:
    ranks = [_whole(shape, r, weights[r], (0, shape.num_layers), True, True) for r in range(world)]
    return _plan("tensor-even", asked, shape, weights, ranks, via_mlx_lm=True)


def _fine_weights(
    shape: ModelShape, weights: list[float], kv: list[int], experts: list[int], split_shared: bool
) -> list[float]:
    """Weights for the MLP columns, shared-expert columns and vocabulary rows that even out
    each rank's parameters, given its whole KV heads and experts (shares.balance)."""
    layers, hidden = shape.num_layers, shape.hidden_size
    # What every rank holds whatever the split: norms, routers, low-rank projections, and the
    # attention itself when its heads cannot split.
    fixed = float(shape.fixed_layer_params * layers + hidden)
    attention = shape.head_group_params * layers
    if not sum(kv):
        fixed += attention * shape.num_kv_heads
    expert = 3 * hidden * shape.expert_size * shape.moe_layers
    held = [fixed + h * attention + e * expert for h, e in zip(kv, experts, strict=True)]
    shared = 3 * hidden * shape.shared_size * shape.moe_layers
    if not split_shared:
        held[0] += shared  # whole on rank 0
    rows = (1 if shape.tie_word_embeddings else 2) * hidden * shape.vocab_size
    columns = 3 * hidden * shape.intermediate_size * shape.dense_layer_count
    return balance(weights, held, columns + rows + (shared if split_shared else 0))


def _tensor_plan(shape: ModelShape, world: int, weights: list[float], asked: str) -> Plan:
    heads_problems = head_problems(shape, world, weights)
    split_heads = not heads_problems
    kv = apportion(shape.num_kv_heads, weights) if split_heads else [0] * world
    experts = apportion(shape.num_experts, weights) if shape.is_moe else [0] * world
    unit = shape.mlp_unit
    split_shared = bool(shape.shared_size) and not column_problems(
        shape.shared_size, unit, world, "shared expert"
    )
    fine_weights = _fine_weights(shape, weights, kv, experts, split_shared)
    kv_spans = _spans_or_none(kv, world)
    group = shape.num_heads // shape.num_kv_heads
    mlp = (
        split(shape.intermediate_size, fine_weights, unit)
        if shape.dense_layer_count
        else [(0, 0)] * world
    )
    if split_shared:
        shared = split(shape.shared_size, fine_weights, unit)
    else:
        shared = [(0, shape.shared_size)] + [(0, 0)] * (world - 1)
    split_vocab = shape.vocab_size >= world  # a config without vocab_size keeps it whole
    vocab = (
        split(shape.vocab_size, fine_weights) if split_vocab else [(0, shape.vocab_size)] * world
    )
    expert_spans = _spans_or_none(experts, world)
    ranks = [
        RankShare(
            rank=r,
            weight=weights[r],
            kv_heads=kv_spans[r] if split_heads else (0, shape.num_kv_heads),
            q_heads=(
                (kv_spans[r][0] * group, kv_spans[r][1] * group)
                if split_heads
                else (0, shape.num_heads)
            ),
            mlp_columns=mlp[r],
            layers=(0, shape.num_layers),
            embeddings=True,
            head=True,
            experts=expert_spans[r],
            shared_columns=shared[r],
            vocab=vocab[r],
        )
        for r in range(world)
    ]
    notes = []
    if shape.is_moe and not split_heads:
        notes.append(f"attention whole on every rank ({'; '.join(heads_problems)})")
    if shape.shared_size and not split_shared:
        notes.append("shared experts whole on rank 0 (too few quantization groups to split)")
    even = is_even(shape, world, weights, split_heads)
    return _plan(
        "tensor-even" if even else "tensor-uneven",
        asked,
        shape,
        weights,
        ranks,
        split_heads=split_heads,
        split_experts=shape.is_moe,
        split_vocab=split_vocab,
        note="; ".join(notes),
    )


def _spans_or_none(counts: list[int], world: int) -> list[Span]:
    return spans(counts) if sum(counts) else [(0, 0)] * world


def _pipeline_plan(
    shape: ModelShape, world: int, weights: list[float], asked: str, via_mlx_lm: bool
) -> Plan:
    if via_mlx_lm:
        return _mlx_lm_pipeline_plan(shape, world, weights, asked)
    layers = split(shape.num_layers, weights)
    last = world - 1
    # A tied head is the embedding matrix, which rank 0 already holds: it applies the head
    # to the final hidden state the last stage sends back, so nothing is stored twice.
    head_rank = 0 if shape.tie_word_embeddings else last
    ranks = [_whole(shape, r, weights[r], layers[r], r == 0, r == head_rank) for r in range(world)]
    return _plan("pipeline", asked, shape, weights, ranks)


def _mlx_lm_pipeline_plan(shape: ModelShape, world: int, weights: list[float], asked: str):
    """mlx-lm's own `pipeline(group, split)`: the layer counts follow the weights, but the
    last rank runs the first layers and rank 0 the last; every rank embeds the tokens and
    applies the final norm and head (after an all_gather of rank 0's hidden state)."""
    counts = [end - start for start, end in split(shape.num_layers, weights)]
    layers = spans(counts[::-1])[::-1]
    ranks = [_whole(shape, r, weights[r], layers[r], True, True) for r in range(world)]
    return _plan("pipeline", asked, shape, weights, ranks, via_mlx_lm=True)
