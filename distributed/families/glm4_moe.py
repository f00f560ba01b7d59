"""glm4_moe (GLM-4.5, GLM-4.6, GLM-4.7): GQA attention with q/k/v biases, optional per-head
q/k norms and partial rotary (both per head); routed plus shared experts from layer
`first_k_dense_replace` on, dense MLPs before. The MTP layer is dropped at load."""

from __future__ import annotations

from typing import Any

from distributed.families.reading import count_layers, dense_mlp, experts, gqa, router_params
from distributed.families.spec import ExpertParts, ShapeFields, moe_family


def read(config: dict[str, Any]) -> ShapeFields:
    layers = int(config["num_hidden_layers"])
    start = int(config.get("first_k_dense_replace") or 0)
    dense, moe = count_layers(config, [i >= start for i in range(layers)])
    shared = int(config.get("n_shared_experts") or 0) * int(config["moe_intermediate_size"])
    fields = {**gqa(config), **dense_mlp(config, dense)}
    fields["fixed_layer_params"] += router_params(config, "n_routed_experts") + int(
        config["n_routed_experts"]
    )
    return {
        **fields,
        **experts(
            config,
            count_key="n_routed_experts",
            size_key="moe_intermediate_size",
            moe_layers=moe,
            shared_size=shared,
        ),
        "tie_word_embeddings": False,
    }


FAMILY = moe_family(
    "glm4_moe",
    read,
    ExpertParts(block="mlp", experts="switch_mlp", router="gate", shared="shared_experts"),
)
