"""A tiny long-context model for the coding-agent tests: SmolLM2's real tokenizer and chat
template (from the GGUF the default model ships in), random weights of a few layers, and
64K positions, so a coding agent's 10-15K-token prompt fits and prefills in seconds.

Its logits depend only on the last token (attention and MLP outputs are zero, so the
residual stream is that token's embedding), and the output rows make the generation
prompt's last token ("\\n" after "<|im_start|>assistant") lead to REPLY, then
<|im_end|>: every free answer is short and known, and a forced tool call is the grammar's.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models import llama
from tokenizers import Tokenizer

from acquisition.gguf_import import read_header
from acquisition.gguf_tokenizer import build_tokenizer_files
from acquisition.source import default_gguf_path

REPLY = "Done."


def write_long_context_model(
    directory: Path, positions: int = 65536, seed: int = 0, layers: int = 1
) -> Path:
    """`layers` above 1: a prefill computes attention over the cache in every chunk (with
    one, a chunk's only attention is the last layer's, which a non-final chunk never
    evaluates: only its KV, not its logits, is needed)."""
    directory.mkdir(parents=True, exist_ok=True)
    metadata = read_header(default_gguf_path()).metadata
    tokenizer_json, tokenizer_config = build_tokenizer_files(metadata, positions)
    (directory / "tokenizer.json").write_text(json.dumps(tokenizer_json))
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    tokenizer = Tokenizer.from_str(json.dumps(tokenizer_json))
    eos = int(metadata["tokenizer.ggml.eos_token_id"])
    config = {
        "model_type": "llama",
        "hidden_size": 64,
        # attention dominates a 13K-token prefill on a CPU: the fewest heads 2 ranks can split
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 128,
        "num_hidden_layers": layers,
        "vocab_size": len(metadata["tokenizer.ggml.tokens"]),
        "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0,
        "max_position_embeddings": positions,
        "tie_word_embeddings": False,
        "eos_token_id": eos,
        "bos_token_id": int(metadata["tokenizer.ggml.bos_token_id"]),
    }
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    embed = mx.random.normal(model.model.embed_tokens.weight.shape)
    model.model.embed_tokens.weight = embed
    weights = dict(tree_flatten(model.parameters()))
    for name in list(weights):
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] = mx.zeros_like(weights[name])
    head = mx.random.normal(embed.shape, key=mx.random.key(seed + 1)) * 0.2
    unit = embed / mx.linalg.norm(embed, axis=1, keepdims=True)
    chain = [*tokenizer.encode("\n").ids[-1:], *tokenizer.encode(REPLY).ids, eos]
    for before, after in zip(chain, chain[1:], strict=False):
        head[after] = head[after] + 3.0 * unit[before]
    weights["lm_head.weight"] = head
    mx.eval(weights)
    mx.save_safetensors(str(directory / "model.safetensors"), weights, metadata={"format": "mlx"})
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return directory


SPECIAL = 17  # SmolLM2's special tokens, every end of sequence among them


def write_endless_model(directory: Path, layers: int) -> Path:
    """The long-context model whose special tokens (SmolLM2's first 17, every end of
    sequence among them) never win a greedy step."""
    write_long_context_model(directory, layers=layers)
    path = directory / "model.safetensors"
    weights = mx.load(str(path))
    eos = json.loads((directory / "config.json").read_text())["eos_token_id"]
    assert eos < SPECIAL, f"end of sequence {eos} is not among the first {SPECIAL} tokens"
    head = weights["lm_head.weight"]
    head[:SPECIAL] = 0.0  # the others' rows give some tokens positive logits, these 0
    weights["lm_head.weight"] = head
    mx.save_safetensors(str(path), weights, metadata={"format": "mlx"})
    return directory
