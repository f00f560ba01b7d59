"""tokenizer.json and tokenizer_config.json built from a GGUF file's tokenizer metadata.

Only llama.cpp's "gpt2" tokenizer model (byte-level BPE) is supported. The pre-tokenizer
is chosen from `tokenizer.ggml.pre`, the name llama.cpp gives to each known regex split;
an unknown name is refused, since a wrong split silently changes every token id.

Why not transformers' GGUF conversion (5.23.0; tests/test_gguf_tokenizer_library.py): its
documented path, `AutoTokenizer.from_pretrained(dir, gguf_file=...)`, imports torch, which
this project does not install (it fails with "No module named 'torch'"). The converter
under it (an internal module) runs without torch and, on the default model's GGUF and the
tests' tiny ones, gives the same vocabulary, merges, added tokens, decoder and token ids
on real text; but it adds no BOS where the GGUF sets add_bos_token (the tiny GGUF with it:
ours encodes <|im_start|> first, it does not), it has no split for llama.cpp's "smollm"
pre-tokenizer (the default model's; it falls back to GPT-2's, without the digit split),
and it builds any unknown pre-tokenizer name silently where this module refuses it. It
also takes about ten times as long (0.86 s against 0.08 s for SmolLM2's 49,152 tokens).
The Qwen2 split regex is transformers' own (`PRETOKENIZE_REGEX`).
"""

from __future__ import annotations

from typing import Any

from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX as _QWEN2_SPLIT

# llama.cpp token types (llama_token_type in llama.h).
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = range(
    1, 7
)

_GPT2_BYTE_LEVEL = {
    "type": "ByteLevel",
    "add_prefix_space": False,
    "trim_offsets": True,
    "use_regex": True,
}

# The split regex of the HF tokenizer (Llama 3's) these GGUF pre-tokenizer names stand for.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _split_then_bytes(pattern: str) -> dict[str, Any]:
    return {
        "type": "Sequence",
        "pretokenizers": [
            {
                "type": "Split",
                "pattern": {"Regex": pattern},
                "behavior": "Isolated",
                "invert": False,
            },
            {
                "type": "ByteLevel",
                "add_prefix_space": False,
                "trim_offsets": False,
                "use_regex": False,
            },
        ],
    }


PRE_TOKENIZERS: dict[str, dict[str, Any]] = {
    "default": _GPT2_BYTE_LEVEL,
    "gpt-2": _GPT2_BYTE_LEVEL,
    "gpt2": _GPT2_BYTE_LEVEL,
    "smollm": {
        "type": "Sequence",
        "pretokenizers": [{"type": "Digits", "individual_digits": True}, _GPT2_BYTE_LEVEL],
    },
    "qwen2": _split_then_bytes(_QWEN2_SPLIT),
    "deepseek-r1-qwen": _split_then_bytes(_QWEN2_SPLIT),
    "llama-bpe": _split_then_bytes(_LLAMA3_SPLIT),
    "llama3": _split_then_bytes(_LLAMA3_SPLIT),
}


class TokenizerImportError(ValueError):
    """The GGUF's tokenizer cannot be expressed as an HF byte-level BPE tokenizer."""


def _token_id(metadata: dict[str, Any], key: str, vocab_size: int) -> int | None:
    value = metadata.get(f"tokenizer.ggml.{key}")
    if value is None:
        return None
    token_id = int(value)
    return token_id if 0 <= token_id < vocab_size else None


def _post_processor(bos: str | None, bos_id: int | None, add_bos: bool) -> dict | None:
    if not (add_bos and bos is not None):
        return None
    special = {bos: {"id": bos, "ids": [bos_id], "tokens": [bos]}}
    return {
        "type": "TemplateProcessing",
        "single": [
            {"SpecialToken": {"id": bos, "type_id": 0}},
            {"Sequence": {"id": "A", "type_id": 0}},
        ],
        "pair": [
            {"SpecialToken": {"id": bos, "type_id": 0}},
            {"Sequence": {"id": "A", "type_id": 0}},
            {"SpecialToken": {"id": bos, "type_id": 1}},
            {"Sequence": {"id": "B", "type_id": 1}},
        ],
        "special_tokens": special,
    }


def byte_level_bpe_json(
    vocab: dict[str, int],
    merges: list[str],
    added: list[dict[str, Any]],
    pre_tokenizer: dict[str, Any],
    post_processor: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A Hugging Face tokenizer.json for a byte-level BPE vocabulary."""
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": post_processor,
        "decoder": {
            "type": "ByteLevel",
            "add_prefix_space": True,
            "trim_offsets": True,
            "use_regex": True,
        },
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": merges,
        },
    }


def build_tokenizer_files(
    metadata: dict[str, Any], context_length: int | None = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Return (tokenizer.json, tokenizer_config.json) contents for a GGUF's metadata."""
    kind = metadata.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise TokenizerImportError(
            f"tokenizer model {kind!r} is not supported; only 'gpt2' (byte-level BPE) is"
        )
    pre = str(metadata.get("tokenizer.ggml.pre", "default"))
    if pre not in PRE_TOKENIZERS:
        raise TokenizerImportError(
            f"tokenizer pre-tokenizer {pre!r} is not supported; supported: "
            + ", ".join(sorted(PRE_TOKENIZERS))
        )
    tokens: list[str] = list(metadata["tokenizer.ggml.tokens"])
    types = metadata.get("tokenizer.ggml.token_type")
    types = [int(t) for t in types] if types is not None else [TOKEN_NORMAL] * len(tokens)
    merges = [str(m) for m in metadata.get("tokenizer.ggml.merges", [])]

    vocab: dict[str, int] = {}
    for token_id, token in enumerate(tokens):
        vocab.setdefault(token, token_id)  # a duplicate string keeps its first id
    added = [
        {
            "id": token_id,
            "content": tokens[token_id],
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": kind_ == TOKEN_CONTROL,
        }
        for token_id, kind_ in enumerate(types)
        if kind_ in (TOKEN_CONTROL, TOKEN_USER_DEFINED) and vocab.get(tokens[token_id]) == token_id
    ]

    size = len(tokens)
    ids = {key: _token_id(metadata, f"{key}_token_id", size) for key in ("bos", "eos", "padding")}
    unk_id = _token_id(metadata, "unknown_token_id", size)
    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", False))
    add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False))
    if add_eos:
        raise TokenizerImportError("tokenizer.ggml.add_eos_token=true is not supported")

    def text(token_id: int | None) -> str | None:
        return tokens[token_id] if token_id is not None else None

    tokenizer_json = byte_level_bpe_json(
        vocab,
        merges,
        added,
        PRE_TOKENIZERS[pre],
        _post_processor(text(ids["bos"]), ids["bos"], add_bos),
    )
    tokenizer_config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": text(ids["bos"]),
        "eos_token": text(ids["eos"]),
        "pad_token": text(ids["padding"]),
        "unk_token": text(unk_id),
        "add_bos_token": add_bos,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(context_length) if context_length else 131072,
    }
    template = metadata.get("tokenizer.chat_template")
    if template:
        tokenizer_config["chat_template"] = str(template)
    return tokenizer_json, tokenizer_config
