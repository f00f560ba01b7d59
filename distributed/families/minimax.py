"""minimax (MiniMax-M2, M2.1): GQA attention whose q/k RMSNorms span the whole projection
width (split heads need a cross-rank sum of squares), partial rotary; routed experts (of
`intermediate_size`) in every layer behind a sigmoid router with a correction bias held on
the block. `shared_intermediate_size` is read by mlx-lm but builds nothing."""

from __future__ import annotations

from typing import Any

from distributed.families.reading import experts_in_every_layer, gqa
from distributed.families.spec import AttentionParts, ExpertParts, ShapeFields, moe_family


def read(config: dict[str, Any]) -> ShapeFields:
    correction = int(config["num_local_experts"])  # the block's e_score_correction_bias
    return {
        **experts_in_every_layer(
            config, gqa(config), count_key="num_local_experts", extra_router=correction
        ),
        "tie_word_embeddings": bool(config.get("tie_word_embeddings", False)),
    }


FAMILY = moe_family(
    "minimax",
    read,
    ExpertParts(block="block_sparse_moe", experts="switch_mlp", router="gate"),
    also_types=("minimax_m2",),
    every_layer=True,
    attention=AttentionParts(
        heads_attr="num_attention_heads",
        kv_heads_attr="num_key_value_heads",
        wide_norms=("q_norm", "k_norm"),
    ),
)
