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


def _module(model_type: str) -> Any:
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


def write_family_model(
    directory: Path, family: str, *, bits: int | None = None, mode: str = "affine", seed: int = 0
) -> Path:
    """Write the tiny `family` model (float32, or quantized: 4-bit affine with groups of 32,
    or mxfp4) to `directory`; returns it."""
    directory.mkdir(parents=True, exist_ok=True)
    vocab = write_byte_tokenizer(directory)
    config = copy.deepcopy(CONFIGS[family])
    config = {key: value for key, value in config.items() if value is not None or key != "head_dim"}
    config |= {
        "vocab_size": vocab,
        "eos_token_id": SPECIAL_TOKENS.index("<|im_end|>") + 256,
        "bos_token_id": None,
    }
    module = _module(config["model_type"])
    model = module.Model(module.ModelArgs.from_dict(config))
    randomize(model, seed)
    if bits is not None:
        group = 32
        model, config = quantize_model(model, config, group, bits, mode=mode)
    mx.eval(model.parameters())
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(directory / "model.safetensors"), weights, metadata={"format": "mlx"})
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return directory
