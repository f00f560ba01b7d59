"""gpt_oss (gpt-oss-20b, gpt-oss-120b): GQA attention with biases and one attention sink per
query head (sliced with the heads), alternating sliding-window and full layers
(`layer_types`, window `sliding_window`), routed experts with biases in every layer, shipped
as mxfp4 (split by expert: no group constraint). The router is a biased Linear."""

from __future__ import annotations

from typing import Any

from distributed.families.reading import experts_in_every_layer, gqa, sliding
from distributed.families.spec import AttentionParts, ExpertParts, ShapeFields, moe_family


def read(config: dict[str, Any]) -> ShapeFields:
    layers = int(config.get("num_hidden_layers", 36))
    config = {
        "num_local_experts": 128,
        "num_experts_per_tok": 4,
        "head_dim": 64,
        "sliding_window": 128,
        **config,
        "num_hidden_layers": layers,
    }
    kinds = config.get("layer_types") or ["sliding_attention", "full_attention"] * (layers // 2)
    attention = gqa(config, per_head=1)  # one sink per query head
    experts = config["num_local_experts"]  # the router's bias
    return {
        **experts_in_every_layer(
            config, attention, count_key="num_local_experts", extra_router=experts
        ),
        **sliding(config, kinds),
        "tie_word_embeddings": False,
    }


FAMILY = moe_family(
    "gpt_oss",
    read,
    ExpertParts(block="mlp", experts="experts", router="router"),
    every_layer=True,
    mask="window",
    attention=AttentionParts(
        heads_attr="num_attention_heads",
        kv_heads_attr="num_key_value_heads",
        per_head_rows=("sinks",),
    ),
)
