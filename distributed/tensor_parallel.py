"""Tensor parallelism for llama/qwen2/qwen3 blocks, even (MLX's own) or uneven (per plan).

Column-parallel layers (q/k/v, gate/up) keep a slice of their output rows; row-parallel
layers (o_proj, down_proj) keep the matching input columns and all_sum their partial
outputs, then add their bias once. Works on the still-lazy model, before evaluation,
so each rank only ever materializes its own slice.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers.distributed import shard_linear

from distributed.plan import Plan, RankShare


class SummedLinear(nn.Module):
    """A row-parallel linear: this rank's input columns, all_sum, then the bias once."""

    def __init__(self, part: nn.Module, bias: mx.array | None, group: mx.distributed.Group):
        super().__init__()
        self.part = part
        if bias is not None:
            self.bias = bias
        self.group = group

    def __call__(self, x: mx.array) -> mx.array:
        y = mx.distributed.all_sum(self.part(x), group=self.group)
        if "bias" in self:
            y = y + self["bias"]
        return y


def _own(view: mx.array) -> mx.array:
    # A slice is a view that would keep the whole tensor's buffer alive; copy it out.
    return mx.contiguous(view)


def _check_affine(layer: nn.Module) -> None:
    if isinstance(layer, nn.QuantizedLinear) and getattr(layer, "mode", "affine") != "affine":
        raise ValueError(f"uneven tensor split supports affine quantization, not {layer.mode}")


def slice_rows(layer: nn.Module, start: int, end: int) -> nn.Module:
    """Keep output rows [start, end) of a Linear/QuantizedLinear (and its bias), in place."""
    _check_affine(layer)
    names = ["weight", "bias"]
    if isinstance(layer, nn.QuantizedLinear):
        names += ["scales", "biases"]
    for name in names:
        if name in layer and layer[name] is not None:
            layer[name] = _own(layer[name][start:end])
    return layer


def slice_columns(
    layer: nn.Module, start: int, end: int, group: mx.distributed.Group
) -> SummedLinear:
    """Keep input columns [start, end) and sum over ranks; quantized cuts fall on groups."""
    _check_affine(layer)
    bias = layer.pop("bias", None)
    if isinstance(layer, nn.QuantizedLinear):
        size, per_word = layer.group_size, 32 // layer.bits
        if start % size or end % size:
            raise ValueError(f"columns {start}-{end} cut a quantization group of {size}")
        layer.weight = _own(layer.weight[:, start // per_word : end // per_word])
        layer.scales = _own(layer.scales[:, start // size : end // size])
        if layer.get("biases") is not None:
            layer.biases = _own(layer.biases[:, start // size : end // size])
    else:
        layer.weight = _own(layer.weight[:, start:end])
    return SummedLinear(layer, bias, group)


def _shard_even(layer: nn.Module, group: mx.distributed.Group) -> None:
    attn, mlp = layer.self_attn, layer.mlp
    for name in ("q_proj", "k_proj", "v_proj"):
        setattr(attn, name, shard_linear(getattr(attn, name), "all-to-sharded", group=group))
    attn.o_proj = shard_linear(attn.o_proj, "sharded-to-all", group=group)
    for name in ("gate_proj", "up_proj"):
        setattr(mlp, name, shard_linear(getattr(mlp, name), "all-to-sharded", group=group))
    mlp.down_proj = shard_linear(mlp.down_proj, "sharded-to-all", group=group)


def _shard_uneven(
    layer: nn.Module, share: RankShare, head_dim: int, group: mx.distributed.Group
) -> None:
    attn, mlp = layer.self_attn, layer.mlp
    q0, q1 = (h * head_dim for h in share.q_heads)
    k0, k1 = (h * head_dim for h in share.kv_heads)
    attn.q_proj = slice_rows(attn.q_proj, q0, q1)
    attn.k_proj = slice_rows(attn.k_proj, k0, k1)
    attn.v_proj = slice_rows(attn.v_proj, k0, k1)
    attn.o_proj = slice_columns(attn.o_proj, q0, q1, group)
    m0, m1 = share.mlp_columns
    mlp.gate_proj = slice_rows(mlp.gate_proj, m0, m1)
    mlp.up_proj = slice_rows(mlp.up_proj, m0, m1)
    mlp.down_proj = slice_columns(mlp.down_proj, m0, m1, group)


def shard_model(model: nn.Module, plan: Plan, group: mx.distributed.Group) -> nn.Module:
    """Shard every block of `model` for this rank per `plan` (in place); returns `model`."""
    if group.size() != plan.world_size:
        raise ValueError(f"plan is for {plan.world_size} ranks, group has {group.size()}")
    share = plan.ranks[group.rank()]
    for layer in model.layers:
        if plan.strategy == "tensor-even":
            _shard_even(layer, group)
        else:
            _shard_uneven(layer, share, plan.shape.head_dim, group)
        # The attention reshapes by these counts, so they must match the local slices.
        layer.self_attn.n_heads = share.q_heads[1] - share.q_heads[0]
        layer.self_attn.n_kv_heads = share.kv_heads[1] - share.kv_heads[0]
    return model
