"""qwen3_moe (Qwen3-30B-A3B, Qwen3-235B-A22B, Qwen3-Coder-480B): qwen3 attention, routed
experts in every `decoder_sparse_step`-th layer except `mlp_only_layers` (those keep a dense
MLP); softmax router, no shared experts."""

from __future__ import annotations

from typing import Any

from distributed.families.reading import count_layers, dense_mlp, experts, gqa, router_params
from distributed.families.spec import ExpertParts, ShapeFields, moe_family


def moe_layers(config: dict[str, Any]) -> list[bool]:
    step = int(config.get("decoder_sparse_step") or 1)
    dense_only = set(config.get("mlp_only_layers") or [])
    count = int(config.get("num_experts") or 0)
    return [
        i not in dense_only and count > 0 and (i + 1) % step == 0
        for i in range(int(config["num_hidden_layers"]))
    ]


def read(config: dict[str, Any]) -> ShapeFields:
    dense, moe = count_layers(config, moe_layers(config))
    fields = {**gqa(config), **dense_mlp(config, dense)}
    fields["fixed_layer_params"] += router_params(config, "num_experts")
    return {
        **fields,
        **experts(
            config, count_key="num_experts", size_key="moe_intermediate_size", moe_layers=moe
        ),
        "tie_word_embeddings": bool(config.get("tie_word_embeddings", False)),
    }


FAMILY = moe_family(
    "qwen3_moe", read, ExpertParts(block="mlp", experts="switch_mlp", router="gate")
)
