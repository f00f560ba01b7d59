"""Tiny random models of every registered family, written like converted mlx-lm models.

Shapes are chosen so every split has something to do at 2 and 3 ranks with weights 2,1,1:
8 query / 4 KV heads (MLA: 4 heads), 8 experts of 64 columns (top 2), shared experts of
128 columns (4 groups of 32), dense MLPs of 128 columns, hidden 64, 2-3 layers, the byte
tokenizer's 259-token vocabulary. Every parameter is random (mlx-lm initializes routers,
correction biases and sinks to zero, which would make routing a tie).
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.utils import MODEL_REMAPPING, quantize_model

from tests.support.tiny_models import SPECIAL_TOKENS, write_byte_tokenizer

HIDDEN = 64
GQA = {
    "hidden_size": HIDDEN,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 16,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 4096,
    "rope_theta": 10000.0,
}
YARN = {
    "type": "yarn",
    "factor": 40.0,
    "original_max_position_embeddings": 4096,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}
MLA = {
    "hidden_size": HIDDEN,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "kv_lora_rank": 64,
    "qk_rope_head_dim": 16,
    "qk_nope_head_dim": 32,
    "v_head_dim": 32,
    "intermediate_size": 128,
    "moe_intermediate_size": 64,
    "n_routed_experts": 8,
    "n_shared_experts": 2,
    "num_experts_per_tok": 2,
    "moe_layer_freq": 1,
    "first_k_dense_replace": 1,
    "num_hidden_layers": 3,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "rope_scaling": YARN,
    "attention_bias": False,
}

CONFIGS: dict[str, dict[str, Any]] = {
    "mistral_swa": {
        **GQA,
        "model_type": "mistral",
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "tie_word_embeddings": True,
        "sliding_window": 8,
        "layer_types": ["sliding_attention", "full_attention"],
    },
    "qwen3_moe": {
        **GQA,
        "model_type": "qwen3_moe",
        "intermediate_size": 128,
        "num_hidden_layers": 3,
        "tie_word_embeddings": False,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [0],
        "moe_intermediate_size": 64,
        "norm_topk_prob": True,
    },
    "mixtral": {
        **GQA,
        "model_type": "mixtral",
        "head_dim": None,  # mixtral derives it: 64 / 8 = 8
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "tie_word_embeddings": False,
    },
    "deepseek_v2": {
        **MLA,
        "model_type": "deepseek_v2",
        "q_lora_rank": None,
        "routed_scaling_factor": 1.0,
        "topk_method": "group_limited_greedy",
        "n_group": 4,
        "topk_group": 2,
    },
    "deepseek_v3": {
        **MLA,
        "model_type": "deepseek_v3",
        "q_lora_rank": 64,
        "routed_scaling_factor": 2.5,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "n_group": 2,
        "topk_group": 1,
    },
    "glm4_moe": {
        **GQA,
        "model_type": "glm4_moe",
        "intermediate_size": 128,
        "moe_intermediate_size": 64,
        "norm_topk_prob": True,
        "n_group": 1,
        "topk_group": 1,
        "n_shared_experts": 2,
        "n_routed_experts": 8,
        "routed_scaling_factor": 2.5,
        "num_experts_per_tok": 2,
        "first_k_dense_replace": 1,
        "num_hidden_layers": 3,
        "rope_scaling": None,
        "use_qk_norm": True,
        "tie_word_embeddings": False,
        "attention_bias": True,
        "partial_rotary_factor": 0.5,
    },
    "gpt_oss": {
        **GQA,
        "model_type": "gpt_oss",
        "num_hidden_layers": 2,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "intermediate_size": 64,
        "sliding_window": 8,
        "rope_theta": 150000,
        "rope_scaling": None,
        "layer_types": ["sliding_attention", "full_attention"],
    },
    "minimax": {
        **GQA,
        "model_type": "minimax",
        "intermediate_size": 64,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "shared_intermediate_size": 0,
        "num_hidden_layers": 2,
        "rope_theta": 5000000.0,
        "rotary_dim": 8,
        "use_qk_norm": True,
        "tie_word_embeddings": False,
    },
}


# Families split through mlx-lm's own shard() (even tensor parallel): 4 query / 2 KV heads.
SMALL_GQA = {**GQA, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2}
SMALL_MLA = {
    **MLA,
    "q_lora_rank": 64,
    "n_shared_experts": 1,
    "num_hidden_layers": 4,  # a dense layer and three MoE layers: 2,1,1 pipelines split them
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.0,
    "rope_scaling": None,
}
LINEAR_ATTENTION = {
    **SMALL_GQA,
    "intermediate_size": 128,
    "linear_num_value_heads": 4,
    "linear_num_key_heads": 2,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "full_attention_interval": 2,
    "num_hidden_layers": 4,  # linear, full, linear, full: a 2,1,1 pipeline splits them unevenly
    "tie_word_embeddings": False,
    "vocab_size": 260,  # mlx-lm shards its head by vocabulary rows: they must divide
}
WINDOWS = {"sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]}
MLX_LM_CONFIGS: dict[str, dict[str, Any]] = {
    "ministral3": {
        **SMALL_GQA,
        "num_hidden_layers": 4,
        "model_type": "ministral3",
        "intermediate_size": 128,
        "tie_word_embeddings": True,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "llama_4_scaling_beta": 0.1,
            "original_max_position_embeddings": 4096,
        },
    },
    "exaone_moe": {
        **SMALL_GQA,
        **WINDOWS,
        "model_type": "exaone_moe",
        "intermediate_size": 128,
        "moe_intermediate_size": 64,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "num_shared_experts": 1,
        "is_moe_layer": [False, True],
    },
    "step3p5": {
        **SMALL_GQA,
        **WINDOWS,
        "model_type": "step3p5",
        "num_attention_groups": 2,
        "intermediate_size": 128,
        "moe_num_experts": 8,
        "moe_top_k": 2,
        "moe_intermediate_size": 64,
        "share_expert_dim": 64,
        "moe_layers_enum": "1",
    },
    "iquestloopcoder": {
        **SMALL_GQA,
        "model_type": "iquestloopcoder",
        "intermediate_size": 128,
        "loop_window_size": 8,
    },
    "glm4_moe_lite": {**SMALL_MLA, "model_type": "glm4_moe_lite"},
    "mistral4": {
        **SMALL_MLA,
        "model_type": "mistral4",
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 4096,
            "llama_4_scaling_beta": 0.1,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
    },
    "deepseek_v32": {
        **SMALL_MLA,
        "model_type": "deepseek_v32",
        "index_head_dim": 32,
        "index_n_heads": 4,
        "index_topk": 8,
    },
    "kimi_k25": {"model_type": "kimi_k25", "text_config": {**SMALL_MLA, "model_type": "kimi_k2"}},
    "qwen3_5": {
        "model_type": "qwen3_5",
        "text_config": {**LINEAR_ATTENTION, "model_type": "qwen3_5_text"},
    },
    "qwen3_5_moe": {
        "model_type": "qwen3_5_moe",
        "text_config": {
            **LINEAR_ATTENTION,
            "model_type": "qwen3_5_moe_text",
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 64,
            "shared_expert_intermediate_size": 64,
        },
    },
    "minimax_m3_vl": {
        "model_type": "minimax_m3_vl",
        "text_config": {
            **SMALL_GQA,
            "intermediate_size": 64,
            "dense_intermediate_size": 128,
            "shared_intermediate_size": 64,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "rotary_dim": 8,
            "num_hidden_layers": 4,
            "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"],
        },
    },
}
MLX_LM_CONFIGS["longcat_flash"] = {
    "model_type": "longcat_flash",
    "attention_method": "MLA",
    "zero_expert_type": "identity",
    "hidden_size": HIDDEN,
    "ffn_hidden_size": 128,
    "moe_topk": 2,
    "expert_ffn_hidden_size": 64,
    "n_routed_experts": 8,
    "zero_expert_num": 2,
    "num_layers": 2,
    "max_position_embeddings": 4096,
    "num_attention_heads": 4,
    "kv_lora_rank": 64,
    "q_lora_rank": 64,
    "qk_rope_head_dim": 16,
    "qk_nope_head_dim": 32,
    "v_head_dim": 32,
    "routed_scaling_factor": 1.0,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "mla_scale_q_lora": True,
    "mla_scale_kv_lora": True,
    "attention_bias": False,
}


# Families whose every layer keeps a plain KVCache (the prefix cache measures and serves
# them); the others keep rotating windows, recurrent state or an indexer's cache too.
PLAIN_KV = {
    "qwen3_moe",
    "mixtral",
    "deepseek_v2",
    "deepseek_v3",
    "glm4_moe",
    "minimax",
    "ministral3",
    "glm4_moe_lite",
    "mistral4",
    "kimi_k25",
}


def mlx_lm_module(model_type: str) -> Any:
    """mlx-lm's module for `model_type` (its Model and ModelArgs)."""
    name = MODEL_REMAPPING.get(model_type, model_type)
    return __import__(f"mlx_lm.models.{name}", fromlist=["Model", "ModelArgs"])


def randomize(model: Any, seed: int) -> None:
    """Give every parameter a random value of a sensible scale."""
    key = mx.random.key(seed)
    fresh = []
    for index, (name, param) in enumerate(tree_flatten(model.parameters())):
        part = mx.random.split(key, index + 2)[-1]
        last = name.rsplit(".", 1)[-1]
        noise = mx.random.normal(param.shape, key=part)
        if "embed_tokens" in name:
            value = noise
        elif param.ndim >= 2:
            value = noise / math.sqrt(param.shape[-1])
        elif "norm" in name and last == "weight":
            value = 1.0 + 0.1 * noise
        elif last in ("sinks", "e_score_correction_bias"):
            value = 0.5 * noise
        else:
            value = 0.05 * noise
        fresh.append((name, value.astype(param.dtype)))
    model.update(tree_unflatten(fresh))


def _hf_mxfp4_experts(weights: dict[str, mx.array], layers: int) -> dict[str, mx.array]:
    """gpt-oss experts as its Hugging Face checkpoints ship them: mxfp4 blocks of 16 bytes
    and byte scales, gate and up rows interleaved in one gate_up_proj (mlx-lm's sanitize
    turns them back into gate_proj/up_proj)."""

    def blocks(packed: mx.array) -> mx.array:  # uint32 [E, out, in/8] -> uint8 [.., in/32, 16]
        raw = packed.view(mx.uint8)
        return raw.reshape(*raw.shape[:-1], -1, 16)

    def interleave(gate: mx.array, up: mx.array) -> mx.array:  # rows g0, u0, g1, u1, ...
        both = mx.stack([gate, up], axis=2)
        return both.reshape(gate.shape[0], 2 * gate.shape[1], *gate.shape[2:])

    out = {k: v for k, v in weights.items() if ".mlp.experts." not in k}
    for layer in range(layers):
        prefix = f"model.layers.{layer}.mlp.experts"
        gate, up, down = (f"{prefix}.{name}" for name in ("gate_proj", "up_proj", "down_proj"))
        out[f"{prefix}.gate_up_proj_blocks"] = blocks(
            interleave(weights[f"{gate}.weight"], weights[f"{up}.weight"])
        )
        out[f"{prefix}.gate_up_proj_scales"] = interleave(
            weights[f"{gate}.scales"], weights[f"{up}.scales"]
        )
        out[f"{prefix}.gate_up_proj_bias"] = interleave(
            weights[f"{gate}.bias"], weights[f"{up}.bias"]
        )
        out[f"{prefix}.down_proj_blocks"] = blocks(weights[f"{down}.weight"])
        out[f"{prefix}.down_proj_scales"] = weights[f"{down}.scales"]
        out[f"{prefix}.down_proj_bias"] = weights[f"{down}.bias"]
    return out


def write_family_model(
    directory: Path, family: str, *, bits: int | None = None, mode: str = "affine", seed: int = 0
) -> Path:
    """Write the tiny `family` model (float32, or quantized: 4-bit affine with groups of 32,
    or mxfp4; "hf-mxfp4": gpt-oss's Hugging Face layout, only the experts mxfp4) to
    `directory`; returns it."""
    directory.mkdir(parents=True, exist_ok=True)
    vocab = write_byte_tokenizer(directory)
    config = copy.deepcopy(CONFIGS.get(family) or MLX_LM_CONFIGS[family])
    config = {key: value for key, value in config.items() if value is not None or key != "head_dim"}
    text = config.get("text_config", config)
    text["vocab_size"] = max(vocab, text.get("vocab_size", 0))
    config |= {"eos_token_id": SPECIAL_TOKENS.index("<|im_end|>") + 256, "bos_token_id": None}
    module = mlx_lm_module(config["model_type"])
    model = module.Model(module.ModelArgs.from_dict(config))
    randomize(model, seed)
    if mode == "hf-mxfp4":
        experts = ("experts.gate_proj", "experts.up_proj", "experts.down_proj")
        nn.quantize(model, 32, 4, mode="mxfp4", class_predicate=lambda p, _: p.endswith(experts))
        config["quantization_config"] = {"quant_method": "mxfp4"}
    elif bits is not None:
        group = 32
        model, config = quantize_model(model, config, group, bits, mode=mode)
    mx.eval(model.parameters())
    weights = dict(tree_flatten(model.parameters()))
    if mode == "hf-mxfp4":
        weights = _hf_mxfp4_experts(weights, config["num_hidden_layers"])
    mx.save_safetensors(str(directory / "model.safetensors"), weights, metadata={"format": "mlx"})
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return directory
