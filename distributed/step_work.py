"""What a plan asks of each rank in one step, read from the plan alone: the weights it
reads (dense parts every step, routed experts only where tokens go), the KV it reads, the
arithmetic, and the collectives the plan makes (count and sizes). The step-time model
(distributed/step_model.py) turns these into milliseconds on given machines and links.

Parameters come from the model's shape (distributed/model_shape.py), the same counts the
planner weighs; bytes from the weights' format (float, affine groups, mxfp4). Where the
safetensors are at hand, `calibrated` scales each rank's figures to its real weight bytes
(distributed/memory.py), so a format this module does not know still reads true.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from distributed.model_shape import ModelShape
from distributed.plan import Plan, RankShare

PLAN_BUFFER_BYTES = 4096  # the step plan's broadcast (distributed/broadcast.py)
LOGIT_BYTES = 4  # logits and the last stage's hand-back travel as float32


def bytes_per_param(shape: ModelShape, activation_bytes: int) -> float:
    """Bytes a weight parameter takes: the float type's, or `bits` plus each group's scale
    (and, affine, its bias) in the activation type."""
    if not shape.quantized or not shape.bits or not shape.group_size:
        return float(activation_bytes)
    if shape.quant_mode == "affine":
        return shape.bits / 8 + 2 * activation_bytes / shape.group_size
    return shape.bits / 8 + 1 / shape.group_size  # mxfp4/mxfp8/nvfp4: one 8-bit scale


@dataclass(frozen=True)
class Collective:
    """`count` collectives of one kind a step, each moving `row_bytes` per token row (or
    `fixed_bytes` whatever the rows)."""

    kind: str  # "all_sum", "send", "all_gather"
    count: int
    row_bytes: float = 0.0
    fixed_bytes: float = 0.0
    what: str = ""

    def nbytes(self, rows: int) -> float:
        return self.fixed_bytes + self.row_bytes * rows


@dataclass(frozen=True)
class RankWork:
    """One rank's part of a step, in parameters and bytes."""

    rank: int
    layers: int  # decoder layers it runs
    moe_layers: int  # of them, with routed experts
    dense_params: float  # read every step: attention, dense MLP, shared experts, norms, routers
    attention_params: float  # of them, the attention projections'
    head_params: float  # the output head's rows it multiplies (read every step)
    expert_params: float  # one routed expert of one MoE layer
    experts_held: int  # routed experts it holds in each MoE layer
    kv_bytes_per_token: float
    heads: int  # query heads whose attention it computes (over the context)
    head_dim: int
    param_bytes: float  # bytes a dense parameter takes
    expert_param_bytes: float  # bytes a routed expert's parameter takes
    weight_bytes: float  # everything it holds (for the memory check and calibration)


@dataclass(frozen=True)
class PlanWork:
    """Every rank's work, the step's collectives, and what the experts' routing needs."""

    strategy: str  # single, tensor, pipeline
    ranks: tuple[RankWork, ...]
    collectives: tuple[Collective, ...]
    num_experts: int
    experts_per_token: int
    activation_bytes: int
    layers: int
    # a tensor plan whose heads are split syncs after attention as well as after the MLP
    attention_synced: bool = False
    # each MoE layer's routes per expert as shares, as serving counted them (distributed/
    # expert_load.py); none: every expert as popular as the next
    expert_shares: tuple[tuple[float, ...], ...] = ()

    @property
    def world(self) -> int:
        return len(self.ranks)

    @property
    def experts_divided(self) -> bool:
        """Whether each routed expert is held whole by one rank (an expert split), not
        sliced across every rank (mlx-lm's shard())."""
        held = sum(r.experts_held for r in self.ranks)
        return self.num_experts > 0 and held == self.num_experts

    @property
    def eager(self) -> bool:
        """Whether the decode step runs uncompiled: a pipeline's stages and the experts'
        routing of an expert split evaluate inside the forward (engine/build.py)."""
        return self.world > 1 and (self.strategy == "pipeline" or self.experts_divided)

    def calibrated(self, weight_bytes: list[int]) -> PlanWork:
        """The same work with each rank's parameters scaled to its real weight bytes (from
        the safetensors headers or the loaded weights)."""
        ranks = []
        for work, real in zip(self.ranks, weight_bytes, strict=True):
            scale = real / work.weight_bytes if work.weight_bytes and real else 1.0
            ranks.append(
                replace(
                    work,
                    param_bytes=work.param_bytes * scale,
                    expert_param_bytes=work.expert_param_bytes * scale,
                    weight_bytes=float(real),
                )
            )
        return replace(self, ranks=tuple(ranks))


def _span(span: tuple[int, int]) -> int:
    return span[1] - span[0]


def _layer_kinds(shape: ModelShape, layers: tuple[int, int]) -> tuple[int, int]:
    """(layers, MoE layers) of a range; a model's dense layers come first (DeepSeek's
    first_k_dense_replace, Kimi K2's first layer), as in every registered family."""
    first_moe = shape.num_layers - shape.moe_layers if shape.is_moe else shape.num_layers
    start, end = layers
    return end - start, max(0, end - max(start, first_moe))


def _rank_work(plan: Plan, share: RankShare, activation_bytes: int, kv_per_token: float):
    s = plan.shape
    hidden = s.hidden_size
    per_param = bytes_per_param(s, activation_bytes)
    world = plan.world_size
    layers, moe = _layer_kinds(s, share.layers)
    dense_layers = layers - moe
    even_shard = plan.via_mlx_lm and plan.is_tensor  # mlx-lm's shard(): 1/world of each
    kv_groups = _span(share.kv_heads)
    if even_shard:
        kv_groups = s.num_kv_heads // world
    attention = kv_groups * s.head_group_params
    columns = _span(share.mlp_columns) if not even_shard else s.intermediate_size // world
    shared = _span(share.shared_columns) if not even_shard else s.shared_size // world
    # mlx-lm's shard() splits every expert's columns: each rank holds all experts, thinner
    experts = _span(share.experts) if not even_shard else s.num_experts
    dense = layers * (attention + s.fixed_layer_params)
    dense += dense_layers * 3 * hidden * columns + moe * 3 * hidden * shared
    vocab_rows = _span(share.vocab) if plan.split_vocab else s.vocab_size
    head = vocab_rows * hidden if share.head else 0
    embedding = vocab_rows * hidden if share.embeddings else 0
    if s.tie_word_embeddings and share.head:
        embedding = 0  # the head reads the embedding matrix itself
    expert = 3 * hidden * s.expert_size // (world if even_shard else 1)
    held = dense + head + embedding + moe * experts * expert
    group = s.num_heads // max(1, s.num_kv_heads)
    return RankWork(
        rank=share.rank,
        layers=layers,
        moe_layers=moe,
        dense_params=float(dense),
        attention_params=float(layers * attention),
        head_params=float(head),
        expert_params=float(expert),
        experts_held=experts if moe else 0,
        kv_bytes_per_token=kv_per_token,
        heads=kv_groups * group,
        head_dim=s.head_dim,
        param_bytes=per_param,
        expert_param_bytes=per_param,
        weight_bytes=held * per_param,
    )


def collectives(plan: Plan, activation_bytes: int) -> tuple[Collective, ...]:
    """The collectives of one forward of the plan (a decode step or a prefill chunk)."""
    s, world = plan.shape, plan.world_size
    if world == 1:
        return ()
    row = s.hidden_size * activation_bytes
    out = [Collective("all_sum", 1, fixed_bytes=PLAN_BUFFER_BYTES, what="step plan broadcast")]
    if plan.is_tensor and plan.via_mlx_lm:
        out.append(Collective("all_sum", 2 * s.num_layers, row, what="mlx-lm shard(): 2 a layer"))
    elif plan.is_tensor:
        # every layer's MLP columns or experts are split: one all_sum; its attention another
        # where the heads are split
        count = s.num_layers * (2 if plan.split_heads else 1)
        out.append(Collective("all_sum", count, row, what="attention and MLP outputs"))
        if plan.split_vocab:
            widest = max(_span(r.vocab) for r in plan.ranks)
            out.append(Collective("all_sum", 1, row, what="embedding lookup"))
            out.append(Collective("all_gather", 1, widest * LOGIT_BYTES, what="the head's logits"))
    elif plan.via_mlx_lm:
        out.append(Collective("send", world - 1, row, what="hidden state to the next stage"))
        out.append(Collective("all_gather", 1, row, what="the last stage's hidden state"))
    else:
        back = (s.hidden_size if s.tie_word_embeddings else s.vocab_size) * LOGIT_BYTES
        out.append(Collective("send", world - 1, row, what="hidden state to the next stage"))
        out.append(Collective("send", 1, back, what="the last stage's output to rank 0"))
    return tuple(out)


def plan_work(
    plan: Plan, activation_bytes: int, kv_bytes_per_token: list[float] | None = None
) -> PlanWork:
    """Every rank's work under `plan`, with analytic parameter counts (call `calibrated`
    with the real weight bytes where they are known). `kv_bytes_per_token`: each rank's
    (distributed/memory.py `kv_bytes`); default none."""
    kv = kv_bytes_per_token or [0.0] * plan.world_size
    ranks = tuple(_rank_work(plan, share, activation_bytes, kv[share.rank]) for share in plan.ranks)
    strategy = "tensor" if plan.is_tensor else plan.strategy
    return PlanWork(
        strategy=strategy,
        ranks=ranks,
        collectives=collectives(plan, activation_bytes),
        num_experts=plan.shape.num_experts,
        experts_per_token=plan.shape.experts_per_token,
        activation_bytes=activation_bytes,
        layers=plan.shape.num_layers,
        attention_synced=plan.is_tensor and (plan.split_heads or plan.via_mlx_lm),
    )
