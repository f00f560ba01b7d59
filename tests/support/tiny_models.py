"""Tiny random models in MLX format, written by the tests themselves (no network).

Each directory looks exactly like a converted mlx-lm model: config.json,
model.safetensors, tokenizer.json and tokenizer_config.json with a ChatML template.
The tokenizer is byte-level BPE with no merges (one token per byte) plus three
special tokens, so any text round-trips.

`write_agent_model` adds what agent features need: thinking and tool-call markers, a
template that takes tools (mlx-lm infers its json_tools parser) and opens a thinking
block, and weights whose greedy answer is known (see AGENT_SCRIPT).
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from transformers.convert_slow_tokenizer import bytes_to_unicode

from acquisition.gguf_tokenizer import byte_level_bpe_json

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_byte_tokenizer(
    directory: Path, words: tuple[str, ...] = (), template: str = CHATML_TEMPLATE
) -> int:
    """Write tokenizer.json/tokenizer_config.json; return the vocabulary size. `words`
    become extra (not special) tokens after the special ones, each decoding to itself."""
    byte_chars = bytes_to_unicode()
    vocab = {byte_chars[b]: b for b in range(256)}
    added = [
        {
            "id": 256 + i,
            "content": token,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": i < len(SPECIAL_TOKENS),
        }
        for i, token in enumerate([*SPECIAL_TOKENS, *words])
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
        "chat_template": template,
        "add_bos_token": False,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return 256 + len(SPECIAL_TOKENS) + len(words)


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
    words: tuple[str, ...] = (),
    template: str = CHATML_TEMPLATE,
    never_stops: bool = False,
) -> Path:
    """Write a random model of the given shape; returns `directory`. `never_stops`: the
    end-of-text token's logit is always 0 while the others spread around it, so greedy
    generation always runs to max_tokens (for tests that need long streams)."""
    directory.mkdir(parents=True, exist_ok=True)
    vocab_size = write_byte_tokenizer(directory, words, template)
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


THINK_START, THINK_END, CALL_START, CALL_END = "<think>", "</think>", "<tool_call>", "</tool_call>"
AGENT_THOUGHT = "The user wants the weather and the time in Paris."
AGENT_CALLS = (
    ("get_weather", {"city": "Paris"}),
    ("get_time", {"timezone": "Europe/Paris"}),
)
AGENT_CALL_TEXTS = tuple(
    f"\n{CALL_START}\n{json.dumps({'name': n, 'arguments': a})}\n{CALL_END}" for n, a in AGENT_CALLS
)
AGENT_WORDS = (THINK_START, THINK_END, CALL_START, CALL_END, AGENT_THOUGHT, *AGENT_CALL_TEXTS)
# Greedy, the agent model follows this chain from the generation prompt's last token (the
# template opens a thinking block, or closes it at once when thinking is off): reasoning,
# then two tool calls, then the end of the turn.
AGENT_SCRIPT = (THINK_START, AGENT_THOUGHT, THINK_END, *AGENT_CALL_TEXTS, "<|im_end|>")
# A Qwen2.5-style template: tools in the system turn, calls as <tool_call> JSON blocks
# (`tool_call.name` and the markers make mlx-lm pick its json_tools parser), tool results
# as <tool_response> blocks, and a thinking block the generation prompt opens.
AGENT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n<tools>\n{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\n"
    'Call a function with <tool_call>\n{"name": <name>, "arguments": <object>}\n</tool_call>'
    "<|im_end|>\n"
    "{% elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}"
    "<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}"
    "\n</tool_response><|im_end|>\n"
    "{% elif message.role == 'assistant' %}<|im_start|>assistant\n"
    "{% if message.reasoning_content %}<think>{{ message.reasoning_content }}</think>{% endif %}"
    "{{ message.content }}"
    "{% for tool_call in message.tool_calls or [] %}"
    "{% if tool_call.function is defined %}{% set tool_call = tool_call.function %}{% endif %}"
    '\n<tool_call>\n{"name": "{{ tool_call.name }}", '
    '"arguments": {{ tool_call.arguments | tojson }}}'
    "\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif message.role != 'system' or not loop.first %}<|im_start|>{{ message.role }}\n"
    "{{ message.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think></think>"
    "{% else %}<think>{% endif %}{% endif %}"
)


def write_agent_tokenizer(directory: Path) -> Path:
    """The agent model's tokenizer alone (for tests that need no weights)."""
    directory.mkdir(parents=True, exist_ok=True)
    write_byte_tokenizer(directory, AGENT_WORDS, AGENT_TEMPLATE)
    return directory


def write_agent_model(directory: Path, seed: int = 0) -> Path:
    """A tiny model for agent features, whose logits depend only on the last token: the
    attention and MLP outputs are zero, so the residual stream is that token's embedding.
    The output rows make each token of AGENT_SCRIPT follow its predecessor by a wide
    margin (greedy answers are known) over small random logits (sampling at temperature
    1 varies; constraints decide what is valid)."""
    write_tiny_model(directory, words=AGENT_WORDS, template=AGENT_TEMPLATE, seed=seed)
    path = str(directory / "model.safetensors")
    weights = mx.load(path)
    for name in list(weights):
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] = mx.zeros_like(weights[name])
    embed = weights["model.embed_tokens.weight"]
    vocab, hidden = embed.shape
    key = mx.random.key(seed + 1)
    head = mx.random.normal((vocab, hidden), key=key) * 0.2
    unit = embed / mx.linalg.norm(embed, axis=1, keepdims=True)
    tokens = json.loads((directory / "tokenizer.json").read_text())["added_tokens"]
    ids = {token["content"]: token["id"] for token in tokens}
    chain = [ids[text] for text in AGENT_SCRIPT]
    for before, after in zip(chain, chain[1:], strict=False):
        head[after] = head[after] + 3.0 * unit[before]
    weights["lm_head.weight"] = head
    mx.save_safetensors(path, weights, metadata={"format": "mlx"})
    return directory


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="Write a tiny random MLX model.")
    parser.add_argument("directory", type=Path)
    parser.add_argument("--model-type", default="llama")
    parser.add_argument("--bits", type=int, default=None)
    args = parser.parse_args()
    print(write_tiny_model(args.directory, model_type=args.model_type, quantize_bits=args.bits))
