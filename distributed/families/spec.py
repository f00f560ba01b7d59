"""The shape every family module fills in: where a family's parts live, how its config
reads into a ModelShape, its KV-cache kind, its masks and the splits it supports.

The planner, the sharders, the pipeline stage, the memory prediction and docs/MODELS.md
all read these records; nothing else knows a family's attribute names.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

# Splits a family can support (docs/MODELS.md has one column per entry):
#   tensor-even   attention heads and MLP columns in equal shares
#   tensor-uneven the same in shares that follow RANK_WEIGHTS
#   expert        each rank holds a contiguous range of every MoE layer's routed experts
#   pipeline      contiguous layer ranges
#   vocab         embeddings and output head split by vocabulary rows (tensor/expert plans)
Split = Literal["tensor-even", "tensor-uneven", "expert", "pipeline", "vocab"]
SPLITS: tuple[Split, ...] = ("tensor-even", "tensor-uneven", "expert", "pipeline", "vocab")
ALL_OURS: frozenset[Split] = frozenset(SPLITS)
DENSE_OURS: frozenset[Split] = frozenset({"tensor-even", "tensor-uneven", "pipeline", "vocab"})

# What a layer's cache holds per token:
#   kv          keys and values per KV head (mlx-lm KVCache)
#   mla-heads   MLA without absorption: full keys and values per query head (deepseek_v2)
#   mla-latent  MLA absorbed: one normalised latent plus the roped key part, shared by
#               every head (deepseek_v3, Kimi K2); it cannot be split by heads
# Layers listed in ModelShape.sliding_layers keep a rotating window instead (RotatingKVCache).
CacheKind = Literal["kv", "mla-heads", "mla-latent"]

# How the family's own forward builds attention masks (the pipeline stage builds the same):
#   shared  one mask from the first layer's cache for every layer
#   window  one mask for full layers and one with the sliding window for sliding layers
#   array   one boolean array mask (deepseek_v3 applies it with mx.where: a "causal" string
#           or an additive mask would be wrong)
MaskKind = Literal["shared", "window", "array"]


@dataclass(frozen=True)
class AttentionParts:
    """Attribute names inside a decoder layer's attention module.

    `query`: the first name present is the query projection whose rows split by query
    head (q_proj, or q_b_proj behind a low-rank query). `key_value`: projections whose
    rows split by KV head (GQA k/v; MLA's kv_b_proj, whose rows run per query head).
    `per_head_rows`: tensors indexed by query head on axis 0 (gpt_oss sinks, MLA's
    embed_q/unembed_out). `wide_norms`: RMSNorms over the whole projection width (q, k),
    which need a cross-rank sum of squares once heads are split (minimax).
    """

    path: str = "self_attn"
    query: tuple[str, ...] = ("q_proj",)
    key_value: tuple[str, ...] = ("k_proj", "v_proj")
    output: str = "o_proj"
    heads_attr: str = "n_heads"
    kv_heads_attr: str | None = "n_kv_heads"
    per_head_rows: tuple[str, ...] = ()
    wide_norms: tuple[str, str] | None = None


@dataclass(frozen=True)
class DenseParts:
    """A SwiGLU MLP: gate and up split by output rows, down by input columns."""

    path: str = "mlp"
    gate: str = "gate_proj"
    up: str = "up_proj"
    down: str = "down_proj"


@dataclass(frozen=True)
class ExpertParts:
    """A mixture-of-experts block inside a decoder layer.

    `experts`: the SwitchGLU holding every routed expert (leading axis = expert);
    `router`: replicated on every rank; `shared`: an ungated dense MLP added to the routed
    output (None when the family has none).
    """

    block: str = "mlp"
    experts: str = "switch_mlp"
    router: str = "gate"
    shared: str | None = None


ShapeFields = dict[str, Any]
# A family's config reader: config.json as a dict -> ModelShape fields.
ShapeReader = Callable[[dict[str, Any]], ShapeFields]


@dataclass(frozen=True)
class Family:
    """One registered family. `read` turns a config.json dict into ModelShape fields."""

    name: str
    model_types: tuple[str, ...]
    read: ShapeReader
    splits: frozenset[Split]
    cache: CacheKind = "kv"
    mask: MaskKind = "shared"
    attention: AttentionParts | None = AttentionParts()
    mlp: DenseParts | None = DenseParts()
    moe: ExpertParts | None = None
    norms: tuple[str, ...] = ("input_layernorm", "post_attention_layernorm")
    # mlx-lm families we do not slice ourselves: their own Model.shard() splits heads and
    # expert intermediates evenly; these config counts must divide by the world size.
    mlx_lm_shard_divides: tuple[str, ...] = ()
    # Pipeline through mlx-lm's own model.pipeline() (else through our PipelineStage).
    mlx_lm_pipeline: bool = False
    note: str = ""

    @property
    def via_mlx_lm(self) -> bool:
        return bool(self.mlx_lm_shard_divides)


def moe_family(
    name: str,
    read: ShapeReader,
    moe: ExpertParts,
    *,
    also_types: tuple[str, ...] = (),
    every_layer: bool = False,
    **parts: Any,
) -> Family:
    """A mixture-of-experts family we split every way (ALL_OURS), for model type `name` and
    `also_types`. `every_layer`: routed experts in every layer, so no dense MLP parts;
    `parts`: the other Family fields where the family differs from the defaults."""
    return Family(
        name=name,
        model_types=(name, *also_types),
        read=read,
        splits=ALL_OURS,
        mlp=None if every_layer else DenseParts(),
        moe=moe,
        **parts,
    )


def first(config: dict[str, Any], *names: str, default: Any = None) -> Any:
    """The first of `names` that the config sets (not None)."""
    for name in names:
        if config.get(name) is not None:
            return config[name]
    return default
