"""The parts of a model config that decide how it can be split."""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict

# Families whose blocks have q/k/v/o_proj + gate/up/down_proj and the llama-style layer loop.
SUPPORTED_FAMILIES = ("llama", "qwen2", "qwen3")
FAMILY_ALIASES = {"mistral": "llama"}


class PlanError(ValueError):
    """A split that cannot be honoured; the message says why and what would work."""


class ModelShape(BaseModel):
    """The parts of a model config that decide how it can be split."""

    model_config = ConfigDict(frozen=True)

    model_type: str
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    num_layers: int
    vocab_size: int
    tie_word_embeddings: bool
    group_size: int | None = None
    bits: int | None = None

    @property
    def family(self) -> str:
        return FAMILY_ALIASES.get(self.model_type, self.model_type)

    @property
    def quantized(self) -> bool:
        return self.bits is not None

    @property
    def mlp_unit(self) -> int:
        """MLP columns move in whole quantization groups (1 column for float weights)."""
        return self.group_size if self.quantized and self.group_size else 1

    @classmethod
    def from_config(cls, config: dict) -> ModelShape:
        """Read a Hugging Face / mlx-lm config.json dictionary."""
        try:
            heads = int(config["num_attention_heads"])
            hidden = int(config["hidden_size"])
            model_type = str(config.get("model_type", "unknown"))
            head_dim = int(config.get("head_dim") or hidden // heads)
            if FAMILY_ALIASES.get(model_type, model_type) == "qwen2":
                head_dim = hidden // heads  # mlx-lm's qwen2 ignores a head_dim entry
            quant = config.get("quantization") or config.get("quantization_config") or {}
            return cls(
                model_type=model_type,
                hidden_size=hidden,
                num_heads=heads,
                num_kv_heads=int(config.get("num_key_value_heads") or heads),
                head_dim=head_dim,
                intermediate_size=int(config["intermediate_size"]),
                num_layers=int(config["num_hidden_layers"]),
                vocab_size=int(config.get("vocab_size", 0)),
                tie_word_embeddings=bool(config.get("tie_word_embeddings", True)),
                group_size=_layer_group_size(quant) if quant.get("bits") else None,
                bits=int(quant["bits"]) if quant.get("bits") else None,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise PlanError(f"model config cannot be planned: missing or bad field {exc}") from None


def _layer_group_size(quant: dict) -> int:
    """The group size every split of a block's projections must respect.

    mlx-lm configs may override quantization per layer ("model.layers.3.mlp.down_proj":
    {"group_size": 64, ...}); a cut must then fall on a boundary of every group size used.
    """
    size = int(quant.get("group_size", 64))
    for key, value in quant.items():
        if isinstance(value, dict) and ".layers." in f".{key}" and value.get("group_size"):
            size = math.lcm(size, int(value["group_size"]))
    return size
