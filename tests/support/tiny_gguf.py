"""Tiny GGUF files written by the tests with the `gguf` package, plus their float reference.

`write_tiny_gguf` draws random float weights for an mlx-lm llama/qwen2/qwen3 model, stores
them in a GGUF the way llama.cpp's converter does (Q and K rows permuted for llama,
matrices in the requested GGML type via `gguf.quants`, norms and biases in F32), and
returns the weights both as drawn and as the chosen type stores them (rounded through
that type). `reference_model` builds the mlx-lm model from either set.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
from gguf import GGMLQuantizationType as GGMLType
from mlx.utils import tree_unflatten
from transformers.convert_slow_tokenizer import bytes_to_unicode

from tests.support.tiny_models import CHATML_TEMPLATE, SPECIAL_TOKENS

TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")
ARCHITECTURES = ("llama", "qwen2", "qwen3")
MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a"), ("1", "2")]
PRE_TOKENIZER = {"llama": "llama-bpe", "qwen2": "qwen2", "qwen3": "qwen2"}

_GGUF_NAMES = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
}
_GGUF_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


@dataclass
class TinyGGUF:
    path: Path
    config: dict
    weights: dict[str, np.ndarray]  # float32 as drawn (mlx-lm names, HF row order)
    stored: dict[str, np.ndarray]  # the same rounded through each tensor's GGML type
    tokens: list[str]


def gguf_name(mlx_key: str) -> str:
    """mlx-lm parameter name -> GGUF tensor name."""
    module, suffix = mlx_key.rsplit(".", 1)
    if module in _GGUF_NAMES:
        return f"{_GGUF_NAMES[module]}.{suffix}"
    _, _, layer, rest = module.split(".", 3)
    return f"blk.{layer}.{_GGUF_LAYER_NAMES[rest]}.{suffix}"


def llama_cpp_permute(rows: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's converter layout for llama Q/K rows: each head's halves interleaved."""
    shape = rows.shape
    return (
        rows.reshape(n_heads, 2, shape[0] // n_heads // 2, *shape[1:]).swapaxes(1, 2).reshape(shape)
    )


def tiny_config(arch: str, vocab_size: int, tied: bool) -> dict:
    return {
        "model_type": arch,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 512,
        "vocab_size": vocab_size,
        "tie_word_embeddings": tied,
    }


def tiny_vocab() -> tuple[list[str], list[int], list[str]]:
    """Specials first (control tokens), the 256 byte characters, then merged tokens."""
    byte_chars = bytes_to_unicode()
    tokens = list(SPECIAL_TOKENS) + [byte_chars[b] for b in range(256)]
    tokens += [left + right for left, right in MERGES]
    types = [3] * len(SPECIAL_TOKENS) + [1] * (len(tokens) - len(SPECIAL_TOKENS))
    return tokens, types, [f"{left} {right}" for left, right in MERGES]


def reference_model(config: dict, weights: dict[str, np.ndarray]):
    """The mlx-lm model of `config` holding `weights` (float32)."""
    module = __import__(f"mlx_lm.models.{config['model_type']}", fromlist=["Model"])
    model = module.Model(module.ModelArgs.from_dict(config))
    model.update(tree_unflatten([(k, mx.array(v)) for k, v in weights.items()]))
    mx.eval(model.parameters())
    return model


def _rounded(value: np.ndarray, kind: str) -> np.ndarray:
    """`value` as a tensor of GGML type `kind` holds it, back in float32."""
    if kind == "F32":
        return value
    if kind == "F16":
        return value.astype(np.float16).astype(np.float32)
    qtype = GGMLType[kind]
    packed = gguf.quants.quantize(value, qtype)
    return gguf.quants.dequantize(packed, qtype).reshape(value.shape).astype(np.float32)


def _store(writer: gguf.GGUFWriter, name: str, value: np.ndarray, kind: str) -> None:
    if kind == "F32":
        writer.add_tensor(name, value)
    elif kind == "F16":
        writer.add_tensor(name, value.astype(np.float16))
    else:
        packed = gguf.quants.quantize(value, GGMLType[kind])
        writer.add_tensor(name, packed, raw_shape=packed.shape, raw_dtype=GGMLType[kind])


def write_tiny_gguf(
    path: Path,
    *,
    arch: str = "llama",
    tensor_type: str = "F32",
    embed_type: str | None = None,
    tied: bool = False,
    permute: bool = True,
    add_bos: bool = False,
    eot_token: str | None = None,
    seed: int = 0,
) -> TinyGGUF:
    """Write a random tiny model as GGUF; matrices in `tensor_type` (embedding: `embed_type`).

    permute=False writes llama Q/K rows unpermuted, i.e. a wrong file (negative control).
    add_bos sets tokenizer.ggml.add_bos_token (the BOS token is <|im_start|>); eot_token
    names an end-of-turn token besides the EOS <|im_end|>.
    """
    tokens, types, merges = tiny_vocab()
    config = tiny_config(arch, len(tokens), tied)
    rng = np.random.default_rng(seed)
    model = reference_model(config, {})
    shapes = {k: v.shape for k, v in _flat(model.parameters()).items()}
    weights: dict[str, np.ndarray] = {}
    for key, shape in sorted(shapes.items()):
        if len(shape) == 1 and key.endswith("norm.weight"):
            weights[key] = (1.0 + 0.2 * rng.standard_normal(shape)).astype(np.float32)
        elif len(shape) == 1:
            weights[key] = (0.5 * rng.standard_normal(shape)).astype(np.float32)
        else:
            scale = 1.0 if "embed_tokens" in key else 1.5 / np.sqrt(shape[1])
            weights[key] = (scale * rng.standard_normal(shape)).astype(np.float32)

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(PRE_TOKENIZER[arch])
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    if eot_token is not None:
        writer.add_eot_token_id(tokens.index(eot_token))
    writer.add_pad_token_id(tokens.index("<|endoftext|>"))
    writer.add_bos_token_id(tokens.index("<|im_start|>"))
    writer.add_add_bos_token(add_bos)
    writer.add_chat_template(CHATML_TEMPLATE)

    stored: dict[str, np.ndarray] = {}
    for key, value in weights.items():
        kind = "F32"
        if value.ndim == 2:
            kind = (embed_type or tensor_type) if "embed_tokens" in key else tensor_type
        on_file = value
        if arch == "llama" and permute and key.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config["num_attention_heads" if "q_proj" in key else "num_key_value_heads"]
            on_file = llama_cpp_permute(value, heads)
        _store(writer, gguf_name(key), on_file, kind)
        # Every type rounds row by row, so rounding commutes with the row permutation.
        stored[key] = _rounded(value, kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return TinyGGUF(path, config, weights, stored, tokens)


def _flat(params: dict, prefix: str = "") -> dict:
    from mlx.utils import tree_flatten

    return dict(tree_flatten(params, prefix=prefix))
