"""deepseek_v2 (DeepSeek-V2, DeepSeek-Coder-V2-Lite): multi-head latent attention without
absorption (its cache holds full keys and values per head, so it splits by heads), routed
plus ungated shared experts from layer `first_k_dense_replace` on (every `moe_layer_freq`-th),
dense MLPs before. `rope_scaling` must carry a `factor` (mlx-lm indexes it)."""

from __future__ import annotations

from typing import Any

from distributed.families.reading import count_layers, dense_mlp, experts, router_params
from distributed.families.spec import AttentionParts, ExpertParts, ShapeFields, moe_family


def moe_layers(config: dict[str, Any]) -> list[bool]:
    routed = config.get("n_routed_experts")
    start = int(config.get("first_k_dense_replace") or 0)
    every = int(config.get("moe_layer_freq") or 1)
    layers = int(config["num_hidden_layers"])
    return [routed is not None and i >= start and i % every == 0 for i in range(layers)]


def mla(config: dict[str, Any], *, absorbed: bool) -> ShapeFields:
    """MLA attention: per head, q rows of nope+rope and o columns of v; kv_b_proj rows of
    nope+v (absorbed: the same weights as embed_q/unembed_out, indexed by head)."""
    hidden = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    nope = int(config.get("qk_nope_head_dim", 128))
    rope = int(config.get("qk_rope_head_dim", 64))
    v_dim = int(config.get("v_head_dim", 128))
    kv_lora = int(config.get("kv_lora_rank", 512))
    q_lora = config.get("q_lora_rank", 1536)  # both ModelArgs default to 1536; V2-Lite sets null
    q_in = int(q_lora) if q_lora else hidden
    fixed = 2 * hidden + hidden * (kv_lora + rope) + kv_lora
    if q_lora:
        fixed += hidden * int(q_lora) + int(q_lora)
    return {
        "num_heads": heads,
        "num_kv_heads": heads,
        "head_dim": nope + rope,
        "v_head_dim": v_dim,
        "kv_rows_per_head": nope + v_dim,
        "head_group_params": (nope + rope) * q_in + (nope + v_dim) * kv_lora + v_dim * hidden,
        "fixed_layer_params": fixed,
        "kv_elements_per_group": 0 if absorbed else nope + rope + v_dim,
        "kv_elements_shared": kv_lora + rope if absorbed else 0,
    }


def deepseek_moe(config: dict[str, Any], fields: ShapeFields) -> ShapeFields:
    dense, moe = count_layers(config, moe_layers(config))
    shared = int(config.get("n_shared_experts") or 0) * int(config.get("moe_intermediate_size", 0))
    if moe:
        fields["fixed_layer_params"] += router_params(config, "n_routed_experts")
    return {
        **fields,
        **dense_mlp(config, dense),
        **(
            experts(
                config,
                count_key="n_routed_experts",
                size_key="moe_intermediate_size",
                moe_layers=moe,
                shared_size=shared,
            )
            if moe
            else {}
        ),
        "tie_word_embeddings": False,
    }


def read(config: dict[str, Any]) -> ShapeFields:
    return deepseek_moe(config, mla(config, absorbed=False))


FAMILY = moe_family(
    "deepseek_v2",
    read,
    ExpertParts(block="mlp", experts="switch_mlp", router="gate", shared="shared_experts"),
    cache="mla-heads",
    attention=AttentionParts(
        query=("q_proj", "q_b_proj"),
        key_value=("kv_b_proj",),
        heads_attr="num_heads",
        kv_heads_attr=None,
    ),
)
