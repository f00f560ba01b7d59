"""Tensor parallelism for every registered family, per plan (even or uneven shares).

Attention splits by whole KV-head groups (query rows, key/value rows, the per-head tensors
and the output projection's input columns; MLA by head), dense MLPs by intermediate columns
(gate/up rows, down columns), MoE layers by expert (distributed/expert_parallel.py) and
the embeddings and head by vocabulary rows (distributed/vocab_parallel.py). Row-parallel
layers all_sum their partial outputs and add their bias once. Where heads cannot split
(an MoE plan says so) attention stays whole on every rank. Families the registry marks
`via_mlx_lm` go through mlx-lm's own `Model.shard()` (even shares only).

Works on the still-lazy model, before evaluation, so each rank only ever materializes its
own slices; with a stand-in group it also predicts each rank's weight bytes (memory.py).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from distributed.expert_parallel import is_moe_block, shard_moe_block
from distributed.families import registered
from distributed.families.spec import AttentionParts, DenseParts
from distributed.model_shape import ModelShape
from distributed.plan import Plan, RankShare
from distributed.slicing import SplitRMSNorm, keep_rows, slice_columns, slice_rows
from distributed.vocab_parallel import split_vocabulary


def split_attention(
    attn: nn.Module,
    parts: AttentionParts,
    share: RankShare,
    shape: ModelShape,
    group: mx.distributed.Group,
) -> None:
    """Keep this rank's heads of one attention module, in place."""
    q0, q1 = share.q_heads
    k0, k1 = share.kv_heads
    query = next(name for name in parts.query if hasattr(attn, name))
    slice_rows(getattr(attn, query), q0 * shape.head_dim, q1 * shape.head_dim)
    for name in parts.key_value:
        slice_rows(getattr(attn, name), k0 * shape.kv_rows, k1 * shape.kv_rows)
    for name in parts.per_head_rows:
        value = getattr(attn, name)
        if isinstance(value, mx.array):
            setattr(attn, name, mx.contiguous(value[q0:q1]))
        else:
            keep_rows(value, q0, q1)
    columns = shape.o_columns_per_head
    setattr(
        attn,
        parts.output,
        slice_columns(getattr(attn, parts.output), q0 * columns, q1 * columns, group),
    )
    if parts.wide_norms is not None and hasattr(attn, parts.wide_norms[0]):
        q_norm, k_norm = parts.wide_norms
        setattr(
            attn,
            q_norm,
            SplitRMSNorm(getattr(attn, q_norm), q0 * shape.head_dim, q1 * shape.head_dim, group),
        )
        setattr(
            attn,
            k_norm,
            SplitRMSNorm(getattr(attn, k_norm), k0 * shape.kv_rows, k1 * shape.kv_rows, group),
        )
    # The attention reshapes by these counts, so they must match the local slices.
    setattr(attn, parts.heads_attr, q1 - q0)
    if parts.kv_heads_attr is not None:
        setattr(attn, parts.kv_heads_attr, k1 - k0)


def split_mlp(
    mlp: nn.Module, parts: DenseParts, share: RankShare, group: mx.distributed.Group
) -> None:
    """Keep this rank's intermediate columns of a dense SwiGLU MLP; its output is summed."""
    m0, m1 = share.mlp_columns
    slice_rows(getattr(mlp, parts.gate), m0, m1)
    slice_rows(getattr(mlp, parts.up), m0, m1)
    setattr(mlp, parts.down, slice_columns(getattr(mlp, parts.down), m0, m1, group))


def shard_model(model: nn.Module, plan: Plan, group: mx.distributed.Group) -> nn.Module:
    """Shard every block of `model` for this rank per `plan` (in place); returns `model`."""
    if group.size() != plan.world_size:
        raise ValueError(f"plan is for {plan.world_size} ranks, group has {group.size()}")
    family = registered(plan.shape.model_type)
    if family is None:
        raise ValueError(f"model type {plan.shape.model_type!r} is not registered")
    if plan.via_mlx_lm:
        model.shard(group)
        return model
    share = plan.ranks[group.rank()]
    for layer in model.model.layers:
        if plan.split_heads and family.attention is not None:
            attn = getattr(layer, family.attention.path)
            split_attention(attn, family.attention, share, plan.shape, group)
        block = getattr(layer, family.moe.block, None) if family.moe else None
        if family.moe is not None and is_moe_block(block, family.moe):
            shard_moe_block(
                layer, family.moe, share.experts, share.shared_columns, group.rank(), group
            )
        elif family.mlp is not None and hasattr(layer, family.mlp.path):
            split_mlp(getattr(layer, family.mlp.path), family.mlp, share, group)
    if plan.split_vocab:
        split_vocabulary(model, [r.vocab for r in plan.ranks], group)
    return model
