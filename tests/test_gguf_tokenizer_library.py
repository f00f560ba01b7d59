"""acquisition/gguf_tokenizer.py against transformers' GGUF tokenizer conversion, on the
default model's GGUF (SmolLM2-135M-Instruct) and the tests' tiny GGUFs: where they agree
and the measured differences that keep ours (its docstring says them). If transformers
closes a difference, the test of it fails: then reconsider using the library."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer

from acquisition.gguf_import import read_header
from acquisition.gguf_tokenizer import TokenizerImportError, build_tokenizer_files
from acquisition.source import ModelSourceError, default_gguf_path
from tests.support.tiny_gguf import write_tiny_gguf

mapping = pytest.importorskip(
    "transformers.integrations.gguf.gguf_tokenizer_mapping",
    reason="transformers moved its GGUF tokenizer converter; compare against the new one",
)

TEXTS = [
    " The capital of France is Paris. It has  two  spaces,\nnewlines\n\nand a tab\t!",
    "def f(x):\n    return {'a': x ** 2}  # a comment\n",
    "Zürich — naïve café, 東京, Москва, emoji 🎉👩‍👩‍👧 and ✓. the theme",
    "2026-11-25 3.14159 1,000,000 12 123 1234",
    "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n",
]


def both(metadata: dict[str, Any]) -> tuple[Tokenizer, Tokenizer]:
    """(ours, transformers') tokenizers for a GGUF's metadata."""
    tokenizer_json, _ = build_tokenizer_files(metadata)
    return Tokenizer.from_str(json.dumps(tokenizer_json)), library(metadata)


def library(metadata: dict[str, Any], **changes: Any) -> Tokenizer:
    fields = {
        name: metadata[f"tokenizer.{key}"]
        for key, name in mapping.GGUF_TOKENIZER_MAPPING["tokenizer"].items()
        if f"tokenizer.{key}" in metadata
    }
    fields = {k: v.tolist() if hasattr(v, "tolist") else v for k, v in fields.items()} | changes
    tokenizer, _ = mapping.convert_gguf_tokenizer(metadata["general.architecture"], fields)
    return tokenizer


def same_tokenizer(ours: Tokenizer, theirs: Tokenizer) -> None:
    mine, other = json.loads(ours.to_str()), json.loads(theirs.to_str())
    assert mine["model"]["vocab"] == other["model"]["vocab"]
    assert mine["model"]["merges"] == other["model"]["merges"]
    assert mine["decoder"] == other["decoder"]
    assert [(a["id"], a["content"], a["special"]) for a in mine["added_tokens"]] == [
        (a["id"], a["content"], a["special"]) for a in other["added_tokens"]
    ]
    for text in TEXTS:
        assert ours.encode(text).ids == theirs.encode(text).ids, text


@pytest.fixture(scope="module")
def smollm2() -> dict[str, Any]:
    try:
        return read_header(default_gguf_path()).metadata
    except ModelSourceError as exc:
        pytest.skip(f"the default model's GGUF is not installed: {exc}")


def test_the_default_model_converts_alike(smollm2: dict[str, Any]) -> None:
    same_tokenizer(*both(smollm2))
    # ... though transformers has no split for llama.cpp's "smollm" pre-tokenizer: it
    # falls back to GPT-2's, without the digit split (SmolLM2's merges join no digits).
    assert smollm2["tokenizer.ggml.pre"] == "smollm"
    assert "smollm" not in mapping.GGUF_PRE_TOKENIZER_SPLITS
    _, theirs = both(smollm2)
    assert json.loads(theirs.to_str())["pre_tokenizer"]["type"] == "ByteLevel"


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_the_tiny_ggufs_convert_alike(tmp_path: Path, arch: str) -> None:
    write_tiny_gguf(tmp_path / "tiny.gguf", arch=arch)
    same_tokenizer(*both(read_header(tmp_path / "tiny.gguf").metadata))


def test_transformers_adds_no_bos_where_the_gguf_asks_for_one(tmp_path: Path) -> None:
    write_tiny_gguf(tmp_path / "tiny.gguf", add_bos=True)
    ours, theirs = both(read_header(tmp_path / "tiny.gguf").metadata)
    assert ours.encode("the").tokens[0] == "<|im_start|>"
    assert theirs.encode("the").tokens[0] != "<|im_start|>"


def test_an_unknown_pre_tokenizer_is_refused_here_and_built_there(tmp_path: Path) -> None:
    write_tiny_gguf(tmp_path / "tiny.gguf")
    metadata = read_header(tmp_path / "tiny.gguf").metadata | {"tokenizer.ggml.pre": "new-one"}
    with pytest.raises(TokenizerImportError, match="'new-one' is not supported"):
        build_tokenizer_files(metadata)
    assert library(metadata).encode("the theme").ids  # no word of the unknown split


@pytest.mark.skipif(importlib.util.find_spec("torch") is not None, reason="torch is installed here")
def test_the_documented_gguf_path_needs_torch(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    write_tiny_gguf(tmp_path / "tiny.gguf")
    with pytest.raises(ImportError, match="read_gguf_metadata"):
        AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="tiny.gguf")
