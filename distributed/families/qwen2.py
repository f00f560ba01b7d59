"""qwen2: GQA attention with q/k/v biases; mlx-lm derives head_dim from hidden / heads
(a `head_dim` entry is ignored)."""

from __future__ import annotations

from typing import Any

from distributed.families.reading import dense_mlp, gqa
from distributed.families.spec import DENSE_OURS, Family, ShapeFields


def read(config: dict[str, Any]) -> ShapeFields:
    heads = int(config["num_attention_heads"])
    return {
        **gqa(config, head_dim=int(config["hidden_size"]) // heads),
        **dense_mlp(config, int(config["num_hidden_layers"])),
        "tie_word_embeddings": bool(config.get("tie_word_embeddings", True)),
    }


FAMILY = Family(name="qwen2", model_types=("qwen2",), read=read, splits=DENSE_OURS)
