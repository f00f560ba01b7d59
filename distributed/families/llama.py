"""llama and what mlx-lm loads through llama.py (mistral, xverse, iquestcoder): GQA
attention, a SwiGLU MLP, optional sliding-window layers (`layer_types` with
`sliding_window`; a Hugging Face mistral `sliding_window` alone is ignored by mlx-lm)."""

from __future__ import annotations

from typing import Any

from distributed.families.reading import dense_mlp, gqa, sliding
from distributed.families.spec import DENSE_OURS, Family, ShapeFields


def read(config: dict[str, Any]) -> ShapeFields:
    layers = int(config["num_hidden_layers"])
    return {
        **gqa(config),
        **dense_mlp(config, layers),
        **sliding(config, config.get("layer_types")),
        "tie_word_embeddings": bool(config.get("tie_word_embeddings", True)),
    }


FAMILY = Family(
    name="llama",
    model_types=("llama", "mistral", "xverse", "iquestcoder"),
    read=read,
    splits=DENSE_OURS,
    mask="window",
)
