"""The parts of a model config that decide how it can be split, read through its family."""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel, ConfigDict


class PlanError(ValueError):
    """A split that cannot be honoured; the message says why and what would work."""


class ModelShape(BaseModel):
    """Counts and sizes the planner splits, read from config.json by the model's family.

    Attention: `num_heads` query heads of `head_dim` rows in the query projection, grouped
    over `num_kv_heads` KV heads (MLA: one group per head); every KV head owns
    `kv_rows_per_head` rows of each key/value projection and every query head
    `v_head_dim` input columns of the output projection. MoE: `moe_layers` layers hold
    `num_experts` routed experts of `expert_size` columns (plus shared experts of
    `shared_size` columns); the other `dense_layers` layers hold a dense MLP of
    `intermediate_size` columns.
    """

    model_config = ConfigDict(frozen=True)

    model_type: str
    family: str = ""  # "" when the model type is not registered
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
    quant_mode: str = "affine"
    v_head_dim: int = 0  # 0: head_dim
    kv_rows_per_head: int = 0  # 0: head_dim
    dense_layers: int = -1  # -1: every layer
    num_experts: int = 0
    experts_per_token: int = 0
    expert_size: int = 0
    shared_size: int = 0
    moe_layers: int = 0
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] = ()
    # Parameters per layer: moving with one KV group (its KV head and query heads), and
    # kept whole on every rank (low-rank projections, norms, router).
    head_group_params: int = 0
    fixed_layer_params: int = 0
    # KV-cache elements per token per layer: per KV group, and shared by all heads (MLA latent).
    kv_elements_per_group: int = 0
    kv_elements_shared: int = 0

    @property
    def quantized(self) -> bool:
        return self.bits is not None

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0 and self.moe_layers > 0

    @property
    def o_columns_per_head(self) -> int:
        return self.v_head_dim or self.head_dim

    @property
    def kv_rows(self) -> int:
        return self.kv_rows_per_head or self.head_dim

    @property
    def dense_layer_count(self) -> int:
        return self.num_layers if self.dense_layers < 0 else self.dense_layers

    @property
    def mlp_unit(self) -> int:
        """MLP columns move in whole quantization groups (1 column for float weights)."""
        return self.group_size if self.quantized and self.group_size else 1

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelShape:
        """Read a Hugging Face / mlx-lm config.json dictionary through the model's family."""
        from distributed.families import registered
        from distributed.families.reading import text_view

        model_type = str(config.get("model_type", "unknown"))
        family = registered(model_type)
        text = text_view(config)
        try:
            fields = family.read(config) if family is not None else _generic(text)
            quant = _quantization(config)
            return cls(
                model_type=model_type,
                family=family.name if family is not None else "",
                vocab_size=int(text.get("vocab_size") or 0),
                num_layers=int(text.get("num_hidden_layers") or text["num_layers"]),
                hidden_size=int(text["hidden_size"]),
                **quant,
                **fields,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise PlanError(f"model config cannot be planned: missing or bad field {exc}") from None


def _generic(config: dict[str, Any]) -> dict[str, Any]:
    """What a single rank needs to describe a model of a family the registry lacks."""
    heads = int(config.get("num_attention_heads") or 1)
    hidden = int(config["hidden_size"])
    return {
        "num_heads": heads,
        "num_kv_heads": int(config.get("num_key_value_heads") or heads),
        "head_dim": int(config.get("head_dim") or hidden // heads),
        "intermediate_size": int(config.get("intermediate_size") or 0),
        "tie_word_embeddings": bool(config.get("tie_word_embeddings", True)),
    }


def _quantization(config: dict[str, Any]) -> dict[str, Any]:
    """Bits, group size and mode of the weights the planner cuts across their input columns.

    mlx-lm configs may override quantization per layer ("model.layers.3.mlp.down_proj":
    {"group_size": 64, ...}); a cut must then fall on a boundary of every group size used by
    a module cut along its input (o_proj, down_proj). Routers and experts are never cut so.
    A Hugging Face `quantization_config` with only a `quant_method` (gpt-oss's mxfp4) covers
    the experts alone, which split by expert: the rest is float.
    """
    quant = config.get("quantization") or config.get("quantization_config") or {}
    if not quant.get("bits"):
        return {}
    size = int(quant.get("group_size", 64))
    for key, value in quant.items():
        if not isinstance(value, dict) or not value.get("group_size"):
            continue
        if key.endswith(("o_proj", "down_proj")) and not _expert_path(key):
            size = math.lcm(size, int(value["group_size"]))
    return {
        "group_size": size,
        "bits": int(quant["bits"]),
        "quant_mode": quant.get("mode", "affine"),
    }


def _expert_path(key: str) -> bool:
    return ".switch_mlp." in key or ".experts." in key


FALLBACK_CONTEXT = 4096  # a config that names no positions (rare): mlx-lm's own default
# Rope scalings that stretch the trained positions by `factor` (HF's config semantics);
# llama3's config already names the stretched length in max_position_embeddings.
_STRETCHING = {"linear", "dynamic", "yarn", "longrope"}


def model_context(config: dict[str, Any]) -> int | None:
    """The positions the model was built for: max_position_embeddings, times the rope
    scaling factor where the scaling stretches the original length; None if unnamed."""
    text = config.get("text_config") or {}
    positions = config.get("max_position_embeddings") or text.get("max_position_embeddings")
    if not positions:
        return None
    scaling = config.get("rope_scaling") or text.get("rope_scaling") or {}
    kind = scaling.get("rope_type") or scaling.get("type")
    factor = scaling.get("factor")
    if kind in _STRETCHING and factor and float(factor) > 1:
        original = scaling.get("original_max_position_embeddings") or positions
        return max(int(positions), int(int(original) * float(factor)))
    return int(positions)
