"""Helpers the family modules share to turn config.json into ModelShape fields."""

from __future__ import annotations

from typing import Any

from distributed.families.spec import ShapeFields, first


def gqa(config: dict[str, Any], *, head_dim: int | None = None, per_head: int = 0) -> ShapeFields:
    """Grouped-query attention: q/k/v/o projections, `per_head` extra values per query
    head (sinks); head_dim from the argument, the config, or hidden / heads."""
    hidden = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    kv_heads = int(first(config, "num_key_value_heads", default=heads))
    dim = head_dim or int(first(config, "head_dim", default=0)) or hidden // heads
    group = max(1, heads // kv_heads)
    # q rows and o columns of `group` query heads, k and v rows of one KV head
    per_group = (2 * group + 2) * dim * hidden + group * per_head
    return {
        "num_heads": heads,
        "num_kv_heads": kv_heads,
        "head_dim": dim,
        "head_group_params": per_group,
        "fixed_layer_params": 2 * hidden,  # the two layer norms
        "kv_elements_per_group": 2 * dim,
    }


def dense_mlp(
    config: dict[str, Any], layers: int, size_key: str = "intermediate_size"
) -> ShapeFields:
    return {"intermediate_size": int(config[size_key]) if layers else 0, "dense_layers": layers}


def experts(
    config: dict[str, Any],
    *,
    count_key: str,
    size_key: str,
    moe_layers: int,
    shared_size: int = 0,
) -> ShapeFields:
    """Routed experts (and an ungated shared MLP) in `moe_layers` layers; the router
    (one row per expert) stays whole on every rank."""
    count = int(config[count_key])
    return {
        "num_experts": count,
        "experts_per_token": int(first(config, "num_experts_per_tok", default=1)),
        "expert_size": int(config[size_key]),
        "shared_size": shared_size,
        "moe_layers": moe_layers,
    }


def experts_in_every_layer(
    config: dict[str, Any], fields: ShapeFields, *, count_key: str, extra_router: int = 0
) -> ShapeFields:
    """`fields` (the attention's) plus routed experts of `intermediate_size` columns in every
    layer and no dense MLP (mixtral, gpt_oss, minimax); the router (and `extra_router`
    values beside it, e.g. a correction bias) stays whole on every rank."""
    layers = int(config["num_hidden_layers"])
    fields["fixed_layer_params"] += router_params(config, count_key) + extra_router
    return {
        **fields,
        "intermediate_size": 0,
        "dense_layers": 0,
        **experts(config, count_key=count_key, size_key="intermediate_size", moe_layers=layers),
    }


def router_params(config: dict[str, Any], count_key: str) -> int:
    return int(config[count_key]) * int(config["hidden_size"])


def sliding(config: dict[str, Any], layer_types: list[str] | None) -> ShapeFields:
    """Layers whose layer_types entry is sliding_attention keep a rotating window."""
    if not layer_types:
        return {}
    window = config.get("sliding_window")
    layers = tuple(i for i, kind in enumerate(layer_types) if kind == "sliding_attention")
    if not layers or not window:
        return {}
    return {"sliding_window": int(window), "sliding_layers": layers}


def count_layers(config: dict[str, Any], is_moe: list[bool]) -> tuple[int, int]:
    """(dense layers, MoE layers)."""
    moe = sum(is_moe)
    return len(is_moe) - moe, moe


def text_view(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's fields: nested `text_config` entries under the top level's."""
    return {**(config.get("text_config") or {}), **config}
