"""leader/detokenize.py against mlx-lm's streaming detokenizers, on the default model's
tokenizer (SmolLM2-135M-Instruct's, built from its GGUF) and real text: ours streams what
`tokenizer.decode(ids, skip_special_tokens=True)` gives; mlx-lm's does not (the reason
leader/detokenize.py keeps its own, stated in its docstring). If a newer mlx-lm gives the
same text, the second test fails: then use the library."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.tokenizer_utils import load as load_tokenizer

from acquisition.gguf_import import read_header
from acquisition.gguf_tokenizer import build_tokenizer_files
from acquisition.source import ModelSourceError, default_gguf_path
from leader.detokenize import IncrementalDecoder, token_bytes

TEXTS = [
    " The capital of France is Paris. It has  two  spaces,\nnewlines\n\nand a tab\t!",
    "def f(x):\n    return {'a': x ** 2}  # a comment\n",
    "Zürich — naïve café, 東京, Москва, emoji 🎉👩‍👩‍👧 and ✓.",
    "a ,b . c ! d ?e 'll don't 2026-11-25 3.14159 1,000,000",
]


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> TokenizerWrapper:
    try:
        gguf = default_gguf_path()
    except ModelSourceError as exc:
        pytest.skip(f"the default model's GGUF is not installed: {exc}")
    tokenizer_json, tokenizer_config = build_tokenizer_files(read_header(gguf).metadata)
    directory = tmp_path_factory.mktemp("smollm2-tokenizer")
    (directory / "tokenizer.json").write_text(json.dumps(tokenizer_json))
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return load_tokenizer(Path(directory))


def ours(tokenizer: TokenizerWrapper, ids: list[int]) -> list[str]:
    decoder = IncrementalDecoder(tokenizer)
    return [decoder.add(token) for token in ids] + [decoder.flush()]


def mlx_lm(tokenizer: TokenizerWrapper, ids: list[int]) -> str:
    detokenizer = tokenizer.detokenizer
    for token in ids:
        detokenizer.add_token(token)
    detokenizer.finalize()
    return detokenizer.text


@pytest.mark.parametrize("text", TEXTS)
def test_ours_streams_what_decode_gives(smollm2: TokenizerWrapper, text: str) -> None:
    ids = smollm2.encode(text, add_special_tokens=False)
    deltas = ours(smollm2, ids)
    assert "".join(deltas) == smollm2.decode(ids, skip_special_tokens=True) == text
    assert not any("\ufffd" in delta for delta in deltas)  # no character split across deltas
    assert b"".join(token_bytes(smollm2, token) for token in ids) == text.encode()


def test_mlx_lms_detokenizer_gives_other_text(smollm2: TokenizerWrapper) -> None:
    assert type(smollm2._detokenizer).__name__ == "BPEStreamingDetokenizer"
    leading = smollm2.encode(TEXTS[0], add_special_tokens=False)
    with_eos = smollm2.encode("Hi", add_special_tokens=False) + [smollm2.eos_token_id]
    found = (mlx_lm(smollm2, leading), mlx_lm(smollm2, with_eos))
    wanted = ("".join(ours(smollm2, leading)), "".join(ours(smollm2, with_eos)))
    assert wanted == (TEXTS[0], "Hi")
    assert found == (TEXTS[0][1:], "Hi<|im_end|>"), (
        "mlx-lm's streaming detokenizer changed: if it now gives the same text as ours, use "
        "it in leader/detokenize.py"
    )
