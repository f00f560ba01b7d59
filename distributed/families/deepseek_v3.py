"""deepseek_v3 (DeepSeek-V3.x, Kimi K2, JoyAI): absorbed multi-head latent attention (the
cache holds one latent and the roped key per token, shared by every head: it cannot be split,
every rank keeps it whole); embed_q/unembed_out split by head; sigmoid router with a
correction bias, grouped top-k; routed plus shared experts after the first dense layers.
The forward applies its mask with mx.where, so masks must be boolean arrays."""

from __future__ import annotations

from typing import Any

from distributed.families.deepseek_v2 import deepseek_moe, mla
from distributed.families.spec import AttentionParts, ExpertParts, ShapeFields, moe_family


def read(config: dict[str, Any]) -> ShapeFields:
    fields = deepseek_moe(config, mla(config, absorbed=True))
    if fields.get("moe_layers"):
        fields["fixed_layer_params"] += int(config["n_routed_experts"])  # correction bias
    return fields


FAMILY = moe_family(
    "deepseek_v3",
    read,
    ExpertParts(block="mlp", experts="switch_mlp", router="gate", shared="shared_experts"),
    also_types=("kimi_k2", "joyai_llm_flash"),
    cache="mla-latent",
    mask="array",
    attention=AttentionParts(
        query=("q_proj", "q_b_proj"),
        key_value=(),
        heads_attr="num_heads",
        kv_heads_attr=None,
        per_head_rows=("embed_q", "unembed_out"),
    ),
)
