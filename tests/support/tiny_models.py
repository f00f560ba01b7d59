"""Tiny random models in MLX format, written by the tests themselves (no network).

Each directory looks exactly like a converted mlx-lm model: config.json,
model.safetensors, tokenizer.json and tokenizer_config.json with a ChatML template.
The tokenizer is byte-level BPE with no merges (one token per byte) plus three
special tokens, so any text round-trips.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from acquisition.gguf_tokenizer import byte_level_bpe_json
from engine.detokenize import byte_level_alphabet

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map."""
    return {byte: char for char, byte in byte_level_alphabet().items()}


def write_byte_tokenizer(directory: Path) -> int:
    """Write tokenizer.json/tokenizer_config.json; return the vocabulary size."""
    byte_chars = _byte_to_unicode()
    vocab = {byte_chars[b]: b for b in range(256)}
    added = [
        {
            "id": 256 + i,
            "content": token,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for i, token in enumerate(SPECIAL_TOKENS)
    ]
    pre_tokenizer = {
        "type": "ByteLevel",
        "add_prefix_space": False,
        "trim_offsets": True,
        "use_regex": True,
    }
    tokenizer = byte_level_bpe_json(vocab, [], added, pre_tokenizer)
    (directory / "tokenizer.json").write_text(json.dumps(tokenizer))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": 4096,
        "chat_template": CHATML_TEMPLATE,
        "add_bos_token": False,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return 256 + len(SPECIAL_TOKENS)


def write_tiny_model(
    directory: Path,
    *,
    model_type: str = "llama",
    hidden_size: int = 64,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    head_dim: int | None = None,
    intermediate_size: int = 128,
    num_hidden_layers: int = 2,
    quantize_bits: int | None = None,
    group_size: int = 32,
    tie_word_embeddings: bool = False,
    seed: int = 0,
    never_stops: bool = False,
) -> Path:
    """Write a random model of the given shape; returns `directory`. `never_stops`: the
    end-of-text token's logit is always 0 while the others spread around it, so greedy
    generation always runs to max_tokens (for tests that need long streams)."""
    directory.mkdir(parents=True, exist_ok=True)
    vocab_size = write_byte_tokenizer(directory)
    config: dict = {
        "model_type": model_type,
        "hidden_size": hidden_size,
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_key_value_heads,
        "head_dim": head_dim or hidden_size // num_attention_heads,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_hidden_layers,
        "vocab_size": vocab_size,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": tie_word_embeddings,
        "eos_token_id": SPECIAL_TOKENS.index("<|im_end|>") + 256,
        "bos_token_id": None,
    }
    if model_type == "qwen2":
        config["attention_bias"] = True
    module = __import__(f"mlx_lm.models.{model_type}", fromlist=["Model", "ModelArgs"])
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(config))
    # Larger-than-default embeddings so logits are not all near zero.
    model.model.embed_tokens.weight = mx.random.normal(model.model.embed_tokens.weight.shape)
    if not tie_word_embeddings:
        shape = model.lm_head.weight.shape
        model.lm_head.weight = mx.random.normal(shape) * (2.0 / hidden_size**0.5)
        if never_stops:
            eos = config["eos_token_id"]
            model.lm_head.weight[eos] = mx.zeros((hidden_size,))
    if quantize_bits:
        nn.quantize(model, group_size=group_size, bits=quantize_bits)
        config["quantization"] = {"group_size": group_size, "bits": quantize_bits}
    mx.eval(model.parameters())
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(directory / "model.safetensors"), weights, metadata={"format": "mlx"})
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return directory


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="Write a tiny random MLX model.")
    parser.add_argument("directory", type=Path)
    parser.add_argument("--model-type", default="llama")
    parser.add_argument("--bits", type=int, default=None)
    args = parser.parse_args()
    print(write_tiny_model(args.directory, model_type=args.model_type, quantize_bits=args.bits))
