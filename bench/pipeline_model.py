"""The default model as a family mlx_lm.server can pipeline, for a 2-rank peer that answers
as the model does.

mlx_lm.server splits a model over ranks by tensor parallel (heads evenly only: SmolLM2-135M's
9 query and 3 KV heads crash it at 2 ranks; bench/even_model.py prunes them, and its
answers are gibberish) or, with `--pipeline`, by layers, which its llama family does not
offer (0.32: qwen2, ministral3, qwen3_moe and the deepseeks do). Ministral 3's decoder layer
is llama's with each query scaled by 1 + beta x log(1 + position // original context): with
beta 0 the scale is exactly 1, so this copy (the same weights and tokenizer, the config
renamed) computes the same logits as the original. Qwen2 would need zero q/k/v biases, and
transformers gives a qwen2 directory Qwen's own tokenizer class, whose pre-tokenizer splits
the text otherwise: the same prompt became other tokens and the edits' answers stopped
copying their files (96% of the JavaScript file's answer copied at 1 rank, 1% so).

    .venv/bin/python -m bench.pipeline_model SRC_DIR DST_DIR
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.model_dir import write_model_dir


def make_pipeline_variant(src: Path, dst: Path) -> Path:
    """Write the ministral3 copy of the llama model at `src` to `dst` (kept when already
    there); returns `dst`."""
    if (dst / "config.json").exists():
        return dst
    config = json.loads((src / "config.json").read_text())
    if config.get("model_type") != "llama":
        raise ValueError(f"{src} is a {config.get('model_type')!r} model; this copies llama")
    if config.get("rope_scaling") or config.get("attention_bias") or config.get("mlp_bias"):
        raise ValueError(f"{src}: rope scaling and biases do not carry over to ministral3")
    context = config.get("max_position_embeddings") or 8192
    config |= {
        "model_type": "ministral3",
        "architectures": ["Ministral3ForCausalLM"],
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": config.get("rope_theta", 10000.0),
            "llama_4_scaling_beta": 0.0,  # every query's scale exactly 1: llama's attention
            "original_max_position_embeddings": context,
        },
    }
    return write_model_dir(src, dst, config)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("src", type=Path)
    parser.add_argument("dst", type=Path)
    args = parser.parse_args()
    print(make_pipeline_variant(args.src, args.dst))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
