"""The default model as a family mlx_lm.server can pipeline, for a 2-rank peer that answers
as the model does.

mlx_lm.server splits a model over ranks by tensor parallel (heads evenly only: SmolLM2-135M's
9 query and 3 KV heads crash it at 2 ranks; bench/even_model.py prunes them, and its
answers are gibberish) or, with `--pipeline`, by layers, which its llama family does not
offer (0.32: qwen2, qwen3_moe and the deepseeks do). Qwen2's decoder layer is llama's with
biases on the query, key and value projections: with those biases zero, this copy computes
the same function as the original (the same tokenizer, weights and rotary base), so both
servers can serve it at 2 ranks and an edit's answer still copies its file.

    .venv/bin/python -m bench.pipeline_model SRC_DIR DST_DIR
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import mlx.core as mx

PROJECTIONS = ("q_proj", "k_proj", "v_proj")


def make_pipeline_variant(src: Path, dst: Path) -> Path:
    """Write the qwen2 copy of the llama model at `src` to `dst` (kept when already there);
    returns `dst`."""
    if (dst / "config.json").exists():
        return dst
    config = json.loads((src / "config.json").read_text())
    if config.get("model_type") != "llama":
        raise ValueError(f"{src} is a {config.get('model_type')!r} model; this copies llama")
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    if head_dim != config["hidden_size"] // config["num_attention_heads"]:
        raise ValueError(f"head_dim {head_dim}: qwen2 takes hidden_size / num_attention_heads")
    if config.get("rope_scaling") or config.get("attention_bias") or config.get("mlp_bias"):
        raise ValueError(f"{src}: rope scaling and biases of its own do not carry over")
    weights: dict[str, mx.array] = {}
    for file in sorted(src.glob("*.safetensors")):
        weights.update(mx.load(str(file)))
    for name in list(weights):
        if name.endswith(tuple(f"self_attn.{p}.weight" for p in PROJECTIONS)):
            rows = weights[name].shape[0]
            weights[name.removesuffix("weight") + "bias"] = mx.zeros((rows,), weights[name].dtype)
    config |= {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}
    tmp = dst.with_name(dst.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
    for file in src.iterdir():
        if file.suffix != ".safetensors" and file.name != "config.json" and file.is_file():
            shutil.copy2(file, tmp / file.name)
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    # mlx-lm's sharded_load reads which file holds each weight from the index
    index = {"metadata": {}, "weight_map": dict.fromkeys(sorted(weights), "model.safetensors")}
    (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    tmp.rename(dst)
    return dst


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("src", type=Path)
    parser.add_argument("dst", type=Path)
    args = parser.parse_args()
    print(make_pipeline_variant(args.src, args.dst))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
