"""Tiny random models of every registered family, written like converted mlx-lm models;
their configs are tests/support/family_configs.py's.

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

from tests.support.family_configs import CONFIGS, MLX_LM_CONFIGS
from tests.support.tiny_models import SPECIAL_TOKENS, write_byte_tokenizer


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
    directory: Path,
    family: str,
    *,
    bits: int | None = None,
    mode: str = "affine",
    seed: int = 0,
    overrides: dict[str, Any] | None = None,
) -> Path:
    """Write the tiny `family` model (float32, or quantized: 4-bit affine with groups of 32,
    or mxfp4; "hf-mxfp4": gpt-oss's Hugging Face layout, only the experts mxfp4) to
    `directory`; returns it. `overrides` change its config (larger sizes, more layers)."""
    directory.mkdir(parents=True, exist_ok=True)
    vocab = write_byte_tokenizer(directory)
    config = copy.deepcopy(CONFIGS.get(family) or MLX_LM_CONFIGS[family]) | (overrides or {})
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
