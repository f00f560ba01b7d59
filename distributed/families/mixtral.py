"""mixtral: GQA attention, routed experts (of `intermediate_size`) in every layer; the
router takes the top-k logits, then a softmax over them. No dense MLP, no shared experts."""

from __future__ import annotations

from typing import Any

from distributed.families.reading import experts_in_every_layer, gqa
from distributed.families.spec import AttentionParts, ExpertParts, ShapeFields, moe_family


def read(config: dict[str, Any]) -> ShapeFields:
    config = {"num_local_experts": 8, "num_experts_per_tok": 2, **config}
    heads = int(config["num_attention_heads"])
    attention = gqa(config, head_dim=int(config["hidden_size"]) // heads)
    return {
        **experts_in_every_layer(config, attention, count_key="num_local_experts"),
        "tie_word_embeddings": bool(config.get("tie_word_embeddings", False)),
    }


FAMILY = moe_family(
    "mixtral",
    read,
    ExpertParts(block="block_sparse_moe", experts="switch_mlp", router="gate"),
    every_layer=True,
    attention=AttentionParts(heads_attr="num_heads", kv_heads_attr="num_key_value_heads"),
)
