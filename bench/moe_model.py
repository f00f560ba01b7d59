"""A random-weight mixture-of-experts model of a few hundred MB, qwen3_moe shaped, for the
benchmark: both servers load it like any mlx-lm model directory.

Hidden 512, 8 layers, 8 query / 4 KV heads of 64, 16 experts of 256 columns (top 4) in
every layer, tied embeddings: about 330 MB in float32. It borrows the tokenizer (and so the
vocabulary) of a real model directory, so prompts and token counts behave as usual; the
answers are random tokens. mlx_lm.server splits it evenly at 2 ranks (8 / 4 heads, 256
columns per expert) but not at 3; ours splits it at 1, 2 and 3 ranks.

    .venv/bin/python -m bench.moe_model TOKENIZER_DIR DST_DIR
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models import qwen3_moe

from bench.model_dir import write_model_dir

SHAPE = {
    "model_type": "qwen3_moe",
    "hidden_size": 512,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "intermediate_size": 1024,
    "moe_intermediate_size": 256,
    "num_experts": 16,
    "num_experts_per_tok": 4,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "norm_topk_prob": True,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "max_position_embeddings": 32768,
    "tie_word_embeddings": True,
}
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
)


def peer_cannot_split(config: dict, ranks: int) -> str | None:
    """Why mlx_lm.server's even shard() cannot split `config`'s model over `ranks` (None
    when it can): it divides heads and MLP/expert columns by the rank count unchecked."""
    for key in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        value = config.get(key)
        if isinstance(value, int) and value % ranks:
            return f"{key}={value} does not divide by {ranks} (mlx_lm.server splits evenly only)"
    moe = config.get("moe_intermediate_size")
    if isinstance(moe, int) and moe % ranks:
        return f"moe_intermediate_size={moe} does not divide by {ranks}"
    return None


def make_moe_model(
    tokenizer_dir: Path, dst: Path, seed: int = 0, shape: dict | None = None
) -> Path:
    """Write the model (SHAPE, or `shape`'s changes to it) to `dst` (skipped when it is
    already there); returns `dst`."""
    if (dst / "config.json").exists():
        return dst
    source = json.loads((tokenizer_dir / "config.json").read_text())
    config = dict(SHAPE, **(shape or {}), vocab_size=int(source["vocab_size"]))
    for key in ("eos_token_id", "bos_token_id"):
        if key in source:
            config[key] = source[key]
    model = qwen3_moe.Model(qwen3_moe.ModelArgs.from_dict(config))
    key = mx.random.key(seed)
    params = []
    for index, (name, value) in enumerate(tree_flatten(model.parameters())):
        noise = mx.random.normal(value.shape, key=mx.random.split(key, index + 2)[-1])
        # matrices scaled by their fan-in; the only vectors here are norm weights
        noise = noise / math.sqrt(value.shape[-1]) if value.ndim >= 2 else 1.0 + 0.1 * noise
        params.append((name, noise.astype(mx.float32)))
    model.update(tree_unflatten(params))
    mx.eval(model.parameters())
    weights = dict(tree_flatten(model.parameters()))
    return write_model_dir(tokenizer_dir, dst, config, weights, TOKENIZER_FILES)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "tokenizer_dir", type=Path, help="a model directory to take the tokenizer from"
    )
    parser.add_argument("dst", type=Path)
    args = parser.parse_args()
    print(make_moe_model(args.tokenizer_dir, args.dst))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
