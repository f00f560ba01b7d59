"""Cutting one rank's part out of a layer's weights, on the still-lazy model.

Row cuts (output rows of a Linear, experts of a SwitchLinear, heads of a MultiLinear,
vocabulary rows of an Embedding) keep a range of the leading axis of every tensor the
module holds, quantized or not: weights, scales and biases all lead with that axis, so no
quantization group is ever cut. Column cuts (input columns of o_proj and down_proj) keep
whole quantization groups and return the bias, which the caller adds once.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

TENSORS = ("weight", "scales", "biases", "bias", "global_scale")


def own(view: mx.array) -> mx.array:
    # A slice is a view that would keep the whole tensor's buffer alive; copy it out.
    return mx.contiguous(view)


def keep_rows(module: nn.Module, start: int, end: int) -> nn.Module:
    """Keep [start, end) of the leading axis of every tensor `module` holds, in place."""
    for name in TENSORS:
        value = module.get(name) if name in module else None
        if isinstance(value, mx.array) and value.ndim > 0:
            module[name] = own(value[start:end])
    return module


def keep_columns(layer: nn.Module, start: int, end: int) -> mx.array | None:
    """Keep input columns [start, end) of a Linear/QuantizedLinear in place; returns its
    bias (removed: a partial output must not add it on every rank)."""
    bias = layer.pop("bias", None)
    if isinstance(layer, nn.QuantizedLinear):
        size, per_word = layer.group_size, 32 // layer.bits
        if start % size or end % size:
            raise ValueError(f"columns {start}-{end} cut a quantization group of {size}")
        layer.weight = own(layer.weight[:, start // per_word : end // per_word])
        layer.scales = own(layer.scales[:, start // size : end // size])
        if layer.get("biases") is not None:
            layer.biases = own(layer.biases[:, start // size : end // size])
    else:
        layer.weight = own(layer.weight[:, start:end])
    return bias


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


def slice_rows(layer: nn.Module, start: int, end: int) -> nn.Module:
    """Keep output rows [start, end) of a Linear/QuantizedLinear (and its bias), in place."""
    return keep_rows(layer, start, end)


def slice_columns(
    layer: nn.Module, start: int, end: int, group: mx.distributed.Group
) -> SummedLinear:
    """Keep input columns [start, end) and sum over ranks; quantized cuts fall on groups."""
    bias = keep_columns(layer, start, end)
    return SummedLinear(layer, bias, group)


class SplitRMSNorm(nn.Module):
    """An RMSNorm over a width that is split across ranks (minimax's q/k norms span every
    head): this rank's slice of the weight; the mean square comes from an all_sum of each
    rank's sum of squares over its own columns."""

    def __init__(self, norm: nn.Module, start: int, end: int, group: mx.distributed.Group) -> None:
        super().__init__()
        self.width = int(norm.weight.shape[0])
        self.weight = own(norm.weight[start:end])
        self.eps = float(norm.eps)
        self.group = group

    def __call__(self, x: mx.array) -> mx.array:
        wide = x.astype(mx.float32)
        squares = mx.distributed.all_sum(mx.square(wide).sum(-1, keepdims=True), group=self.group)
        scale = mx.rsqrt(squares / self.width + self.eps)
        return (wide * scale * self["weight"].astype(mx.float32)).astype(x.dtype)
