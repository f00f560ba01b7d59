"""Families split through mlx-lm's own Model.shard() (even tensor parallel) and by layers
(uneven by weight): through mlx-lm's own `pipeline()` where the family's model has one,
else through our pipeline stage where the forward is the plain one it rebuilds (embed,
layers with a full and a sliding-window mask, norm, head).

mlx-lm 0.32 ships a `shard()` for these architectures (linear attention, indexers, MLA
variants, vision-language wrappers) whose layers we do not slice ourselves. Its shard()
splits heads and MLP/expert intermediates into equal parts without checking that they
divide, so the planner checks `mlx_lm_shard_divides` (head counts) and, for quantized
weights, that every rank's columns are whole quantization groups. The KV prediction for
them counts full GQA or latent caches in every layer: an upper bound where some layers
keep recurrent state instead.
"""

from __future__ import annotations

from typing import Any, Literal

from distributed.families.reading import gqa, sliding, text_view
from distributed.families.spec import Family, MaskKind, ShapeFields, Split, first

TENSOR_EVEN: frozenset[Split] = frozenset({"tensor-even"})
WITH_PIPELINE: frozenset[Split] = TENSOR_EVEN | {"pipeline"}
# How a family splits by layers: "mlx-lm" (its PipelineMixin: masks and caches follow the
# family's own forward, so linear attention and indexer caches keep working), "stage" (our
# PipelineStage, for families without one whose forward is the plain one) or None
# (iquestloopcoder runs every layer twice a token, in two loops: no contiguous ranges).
Pipeline = Literal["mlx-lm", "stage"] | None


def read_gqa(config: dict[str, Any]) -> ShapeFields:
    text = text_view(config)
    if "num_attention_groups" in text:  # step3p5 names its KV heads so
        text = {**text, "num_key_value_heads": text["num_attention_groups"]}
    return {
        **gqa(text),
        "intermediate_size": int(first(text, "intermediate_size", "ffn_hidden_size", default=0)),
        "tie_word_embeddings": bool(text.get("tie_word_embeddings", False)),
    }


def read_windows(config: dict[str, Any]) -> ShapeFields:
    """read_gqa plus the sliding-window layers that `layer_types` names."""
    text = text_view(config)
    return {**read_gqa(config), **sliding(text, text.get("layer_types"))}


def read_step3p5(config: dict[str, Any]) -> ShapeFields:
    """read_windows with mlx-lm's step3p5 defaults: even layers slide, a 512-token window."""
    text = {"sliding_window": 512, **text_view(config)}
    layers = int(text["num_hidden_layers"])
    kinds = text.get("layer_types") or [
        "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)
    ]
    return {**read_gqa(config), **sliding(text, kinds)}


def read_mla(config: dict[str, Any]) -> ShapeFields:
    text = text_view(config)
    heads = int(text["num_attention_heads"])
    nope, rope = int(text.get("qk_nope_head_dim", 128)), int(text.get("qk_rope_head_dim", 64))
    return {
        "num_heads": heads,
        "num_kv_heads": heads,
        "head_dim": nope + rope,
        "v_head_dim": int(text.get("v_head_dim", 128)),
        "intermediate_size": int(first(text, "intermediate_size", "ffn_hidden_size", default=0)),
        "kv_elements_shared": int(text.get("kv_lora_rank", 512)) + rope,
        "tie_word_embeddings": bool(text.get("tie_word_embeddings", False)),
    }


def _family(
    name: str,
    read: Any,
    divides: tuple[str, ...],
    note: str,
    pipeline: Pipeline = "mlx-lm",
    mask: MaskKind = "window",
) -> Family:
    """`mask`: how the family's forward builds its masks, for our pipeline stage."""
    return Family(
        name=name,
        model_types=(name,),
        read=read,
        splits=WITH_PIPELINE if pipeline else TENSOR_EVEN,
        mlx_lm_pipeline=pipeline == "mlx-lm",
        mask=mask,
        attention=None,
        mlp=None,
        mlx_lm_shard_divides=divides,
        note=note,
    )


GQA_HEADS = ("num_attention_heads", "num_key_value_heads")

FAMILIES: tuple[Family, ...] = (
    _family("ministral3", read_gqa, GQA_HEADS, "llama-4 rope scaling, optional windows"),
    _family(
        "exaone_moe",
        read_windows,
        GQA_HEADS,
        "sliding windows, MoE with shared experts",
        pipeline="stage",
    ),
    _family(
        "step3p5",
        read_step3p5,
        ("num_attention_heads", "num_attention_groups"),
        "sliding windows, head-wise attention gate, shared expert",
        pipeline="stage",
    ),
    _family(
        "iquestloopcoder",
        read_gqa,
        GQA_HEADS,
        "looped layers with per-head gates: every token runs all layers twice",
        pipeline=None,
    ),
    _family("glm4_moe_lite", read_mla, ("num_attention_heads",), "absorbed MLA, MoE"),
    _family("mistral4", read_mla, ("num_attention_heads",), "absorbed MLA, MoE"),
    _family("deepseek_v32", read_mla, ("num_attention_heads",), "MLA with a sparse indexer"),
    _family("kimi_k25", read_mla, ("num_attention_heads",), "deepseek_v3 text model in a VLM"),
    _family(
        "qwen3_5",
        read_gqa,
        (*GQA_HEADS, "linear_num_value_heads", "linear_num_key_heads", "vocab_size"),
        "gated delta-net linear attention (recurrent state), vocabulary-sharded head",
    ),
    _family(
        "qwen3_5_moe",
        read_gqa,
        (*GQA_HEADS, "linear_num_value_heads", "linear_num_key_heads", "vocab_size"),
        "qwen3_5 with routed and shared experts",
    ),
    _family("minimax_m3_vl", read_gqa, GQA_HEADS, "sparse-attention index, dense and MoE layers"),
    _family(
        "longcat_flash",
        read_mla,
        ("num_attention_heads",),
        "two MLA attentions a layer, zero experts",
        pipeline="stage",
        mask="array",
    ),
)
# Not registered, so refused by name beyond one rank: muse_spark (its forward needs a Metal
# kernel: it cannot be verified on the Linux machines the tests run on), longcat_flash_ngram
# (its n-gram context cache cannot batch a prompt shorter than the context beside a longer
# one: mlx-lm's ArraysCache.extend fails), kimi_k3 and deepseek_v41 (linear-attention and
# hyper-connection layers with caches of their own that no test here builds yet).
