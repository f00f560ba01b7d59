"""qwen3: GQA attention with per-head q/k RMSNorms (they move with their heads)."""

from __future__ import annotations

from typing import Any

from distributed.families.reading import dense_mlp, gqa
from distributed.families.spec import DENSE_OURS, Family, ShapeFields


def read(config: dict[str, Any]) -> ShapeFields:
    return {
        **gqa(config),
        **dense_mlp(config, int(config["num_hidden_layers"])),
        "tie_word_embeddings": bool(config.get("tie_word_embeddings", True)),
    }


FAMILY = Family(name="qwen3", model_types=("qwen3",), read=read, splits=DENSE_OURS)
