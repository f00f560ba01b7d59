"""A variant of a GQA llama model whose head counts divide evenly, for a 2-rank peer run.

mlx_lm.server splits attention heads evenly only: SmolLM2-135M (9 query heads, 3 KV heads)
crashes it at 2 ranks. This keeps the first `kv_heads` KV heads and the query heads that
attend to them (a pruned sub-network of the real model: same tokenizer, layers, MLPs and
embeddings), so both servers can run the same model at 2 ranks.

    .venv/bin/python -m bench.even_model SRC_DIR DST_DIR [--kv-heads 2]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import mlx.core as mx

from bench.model_dir import write_model_dir


def make_even_variant(src: Path, dst: Path, kv_heads: int = 2) -> Path:
    """Write the pruned model to `dst` (skipped when it is already there); returns `dst`."""
    if (dst / "config.json").exists():
        return dst
    config = json.loads((src / "config.json").read_text())
    heads, old_kv = config["num_attention_heads"], config["num_key_value_heads"]
    if not 0 < kv_heads <= old_kv:
        raise ValueError(f"kv_heads={kv_heads} must be within 1..{old_kv}")
    group = heads // old_kv
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    keep_q = group * kv_heads * head_dim  # query heads 0..group*kv_heads-1 use KV heads kept
    keep_kv = kv_heads * head_dim
    weights: dict[str, mx.array] = {}
    for file in sorted(src.glob("*.safetensors")):
        weights.update(mx.load(str(file)))
    for name in list(weights):
        if name.endswith("self_attn.q_proj.weight"):
            weights[name] = weights[name][:keep_q]
        elif name.endswith(("self_attn.k_proj.weight", "self_attn.v_proj.weight")):
            weights[name] = weights[name][:keep_kv]
        elif name.endswith("self_attn.o_proj.weight"):
            weights[name] = weights[name][:, :keep_q]
        elif name.endswith(("q_proj.bias",)):
            weights[name] = weights[name][:keep_q]
        elif name.endswith(("k_proj.bias", "v_proj.bias")):
            weights[name] = weights[name][:keep_kv]
    # Pruned heads make the model end its answers at once: an untied output head whose
    # stop-token rows are zero (logit 0, below the usual winners) keeps it talking.
    if config.get("tie_word_embeddings", False) or "lm_head.weight" not in weights:
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    stops = {config.get("eos_token_id"), 0}
    stops |= set(config["eos_token_id"]) if isinstance(config.get("eos_token_id"), list) else set()
    rows = mx.array([i for i in stops if isinstance(i, int)])
    head = mx.array(weights["lm_head.weight"])
    head[rows] = 0.0
    weights["lm_head.weight"] = head
    config |= {
        "tie_word_embeddings": False,
        "num_attention_heads": group * kv_heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
    }
    return write_model_dir(src, dst, config, weights)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("src", type=Path)
    parser.add_argument("dst", type=Path)
    parser.add_argument("--kv-heads", type=int, default=2)
    args = parser.parse_args()
    print(make_even_variant(args.src, args.dst, args.kv_heads))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
