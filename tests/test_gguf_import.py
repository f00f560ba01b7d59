"""GGUF import: tiny GGUF files written here, imported, and compared with their float reference."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load
from mlx_lm.utils import load_model
from transformers import AutoTokenizer

from acquisition.gguf_import import GGUFImportError, _read_bf16, import_gguf, read_header
from tests.support.tiny_gguf import (
    ARCHITECTURES,
    TENSOR_TYPES,
    reference_model,
    tiny_vocab,
    write_tiny_gguf,
)

TOKENS = mx.array([[5, 40, 77, 100, 200, 3, 9, 150, 260, 33]])
# Largest logit error allowed against the float model, relative to the largest logit:
# what storing every matrix in that type costs on these random weights (measured 0.3 for
# 4-bit, 0.02 for Q8_0, 0.01 for BF16, 0.001 for F16).
FLOAT_TOLERANCE = {"F32": 1e-5, "F16": 5e-3, "BF16": 3e-2, "Q8_0": 6e-2, "Q4_0": 0.6, "Q4_1": 0.6}


def _logits(model) -> np.ndarray:
    return np.array(model(TOKENS).astype(mx.float32))


def _import(tmp_path: Path, dtype: str, **tiny_args):
    tiny = write_tiny_gguf(tmp_path / "tiny.gguf", **tiny_args)
    out = tmp_path / f"mlx-{dtype}"
    config = import_gguf(tiny.path, out, dtype, "float32")
    model, _ = load_model(out)
    return tiny, config, model, out


CASES = [
    (arch, kind, dtype)
    for arch in ARCHITECTURES
    for kind in TENSOR_TYPES
    for dtype in (("float32", "quantized") if kind.startswith("Q") else ("float32",))
]


@pytest.mark.parametrize(("arch", "kind", "dtype"), CASES)
def test_tiny_gguf_matches_reference_logits(tmp_path, arch, kind, dtype):
    tiny, config, model, _ = _import(tmp_path, dtype, arch=arch, tensor_type=kind)
    got = _logits(model)
    scale = np.abs(_logits(reference_model(tiny.config, tiny.weights))).max()
    # Same weights as the file holds them: only float rounding may differ.
    stored = _logits(reference_model(tiny.config, tiny.stored))
    assert np.abs(got - stored).max() <= 1e-4 * scale
    exact = _logits(reference_model(tiny.config, tiny.weights))
    assert np.abs(got - exact).max() <= FLOAT_TOLERANCE[kind] * scale
    assert config["model_type"] == arch
    assert ("quantization" in config) == (dtype == "quantized")
    if dtype == "quantized":
        assert type(model.model.layers[0].self_attn.q_proj).__name__ == "QuantizedLinear"


def test_unpermuted_llama_file_gives_wrong_logits(tmp_path):
    """Negative control: the logits test notices Q/K rows in the wrong order."""
    tiny, _, model, _ = _import(tmp_path, "float32", arch="llama", permute=False)
    reference = _logits(reference_model(tiny.config, tiny.weights))
    assert np.abs(_logits(model) - reference).max() > 0.05 * np.abs(reference).max()


def test_mixed_types_tied_embedding_like_the_default_model(tmp_path):
    """Q8_0 embedding, Q4_1 matrices, no output tensor: per-layer quantization in config."""
    tiny, config, model, out = _import(
        tmp_path, "quantized", arch="llama", tensor_type="Q4_1", embed_type="Q8_0", tied=True
    )
    assert config["tie_word_embeddings"] is True
    assert config["quantization"]["bits"] == 4
    assert config["quantization"]["model.embed_tokens"] == {"group_size": 32, "bits": 8}
    assert json.loads((out / "config.json").read_text())["quantization"] == config["quantization"]
    stored = _logits(reference_model(tiny.config, tiny.stored))
    assert np.abs(_logits(model) - stored).max() <= 1e-4 * np.abs(stored).max()


def test_header_reports_tensor_types_and_shapes(tmp_path):
    tiny = write_tiny_gguf(tmp_path / "t.gguf", arch="qwen3", tensor_type="Q4_0")
    header = read_header(tiny.path)
    assert header.metadata["general.architecture"] == "qwen3"
    assert header.tensors["blk.0.attn_q.weight"].type_name == "Q4_0"
    assert header.tensors["blk.0.attn_q.weight"].shape == (64, 64)
    assert header.tensors["blk.1.attn_k_norm.weight"].type_name == "F32"
    assert list(header.metadata["tokenizer.ggml.tokens"]) == tiny.tokens


def _minimal_gguf(path: Path, arch: str, qtype: gguf.GGMLQuantizationType, cols: int) -> Path:
    writer = gguf.GGUFWriter(str(path), arch)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    data = np.zeros((4, cols // block * size), dtype=np.uint8)
    writer.add_tensor("token_embd.weight", data, raw_shape=data.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("qtype", ["Q6_K", "Q5_0", "Q4_K"])
def test_unsupported_tensor_type_is_refused_by_name(tmp_path, qtype):
    path = _minimal_gguf(tmp_path / "x.gguf", "llama", gguf.GGMLQuantizationType[qtype], 256)
    with pytest.raises(GGUFImportError) as error:
        import_gguf(path, tmp_path / "out")
    message = str(error.value)
    assert f"type {qtype}" in message
    assert "F32, F16, BF16, Q8_0, Q4_0, Q4_1" in message
    assert not (tmp_path / "out").exists()


def test_unsupported_architecture_is_refused_by_name(tmp_path):
    path = _minimal_gguf(tmp_path / "g.gguf", "gemma", gguf.GGMLQuantizationType.Q8_0, 32)
    with pytest.raises(GGUFImportError, match="architecture 'gemma' is not supported"):
        import_gguf(path, tmp_path / "out")


def test_tiny_tokenizer_from_gguf_metadata(tmp_path):
    _, _, _, out = _import(tmp_path, "float32", arch="llama", tensor_type="F16")
    tokens, types, _ = tiny_vocab()
    tokenizer = AutoTokenizer.from_pretrained(out)
    for token_id, kind in enumerate(types):
        if kind == 3:
            assert tokenizer.convert_tokens_to_ids(tokens[token_id]) == token_id
    assert tokenizer.eos_token_id == tokens.index("<|im_end|>")
    assert tokenizer.pad_token_id == tokens.index("<|endoftext|>")
    ids = tokenizer.encode("the then in 12", add_special_tokens=True)
    # The merges apply ("Ġthe", "in", "12" are one token each) and no BOS is added.
    assert tokens[ids[0]] == "t"
    assert [tokens[i] for i in ids[1:]] == ["he", "Ġthe", "n", "Ġ", "in", "Ġ", "12"]
    assert tokenizer.decode(ids) == "the then in 12"
    special = tokenizer.encode("<|im_start|>x<|im_end|>")
    assert special == [tokens.index("<|im_start|>"), tokens.index("x"), tokens.index("<|im_end|>")]
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_import(tmp_path, dtype):
    tiny, _, model, _ = _import(tmp_path, dtype, arch="llama", tensor_type="Q4_0")
    assert model.model.layers[0].mlp.up_proj.weight.dtype == getattr(mx, dtype)
    stored = _logits(reference_model(tiny.config, tiny.stored))
    assert np.abs(_logits(model) - stored).max() <= 3e-2 * np.abs(stored).max()


def test_bf16_keeps_values_beyond_float16_range(tmp_path):
    """mx.load narrows BF16 to float16 (max 65504); the importer reads BF16 itself."""
    values = np.array([[1e6, -3e5, 1.5, 70000.0] * 8] * 2, dtype=np.float32)
    writer = gguf.GGUFWriter(str(tmp_path / "b.gguf"), "llama")
    packed = gguf.quants.quantize(values, gguf.GGMLQuantizationType.BF16)
    writer.add_tensor("token_embd.weight", packed, raw_dtype=gguf.GGMLQuantizationType.BF16)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    info = read_header(tmp_path / "b.gguf").tensors["token_embd.weight"]
    expected = gguf.quants.dequantize(packed, gguf.GGMLQuantizationType.BF16)
    got = np.array(_read_bf16(tmp_path / "b.gguf", info).astype(mx.float32))
    assert np.array_equal(got, expected.reshape(values.shape))
    assert got.max() > 9e5


def test_add_bos_token_prepends_bos_once(tmp_path):
    tiny = write_tiny_gguf(tmp_path / "b.gguf", arch="llama", add_bos=True)
    import_gguf(tiny.path, tmp_path / "out", "float32")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "out")
    bos = tiny.tokens.index("<|im_start|>")
    assert tokenizer.bos_token_id == bos
    ids = tokenizer.encode("he")
    assert ids == [bos, tiny.tokens.index("he")]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "he"


def test_split_gguf_is_refused(tmp_path):
    writer = gguf.GGUFWriter(str(tmp_path / "s.gguf"), "llama")
    writer.add_uint16("split.count", 3)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(GGUFImportError, match="split GGUF"):
        import_gguf(tmp_path / "s.gguf", tmp_path / "out")


@pytest.mark.parametrize("keep", [0, 100, 0.6])
def test_damaged_file_is_refused_with_one_message(tmp_path, keep):
    tiny = write_tiny_gguf(tmp_path / "t.gguf", tensor_type="Q8_0")
    data = tiny.path.read_bytes()
    tiny.path.write_bytes(data[: int(keep * len(data)) if isinstance(keep, float) else keep])
    with pytest.raises(GGUFImportError, match="t.gguf"):
        import_gguf(tiny.path, tmp_path / "out")


def test_quantized_with_float16_scales_as_on_metal(tmp_path):
    tiny = write_tiny_gguf(tmp_path / "m.gguf", arch="qwen2", tensor_type="Q4_1", embed_type="Q8_0")
    import_gguf(tiny.path, tmp_path / "out", "quantized", "float16")
    model, _ = load_model(tmp_path / "out")
    assert model.model.layers[0].mlp.up_proj.scales.dtype == mx.float16
    assert model.model.norm.weight.dtype == mx.float16
    stored = _logits(reference_model(tiny.config, tiny.stored))
    assert np.abs(_logits(model) - stored).max() <= 2e-2 * np.abs(stored).max()


def test_end_of_turn_token_also_stops_generation(tmp_path):
    tiny = write_tiny_gguf(tmp_path / "e.gguf", arch="qwen3", eot_token="<|endoftext|>")
    config = import_gguf(tiny.path, tmp_path / "out", "float32")
    stops = [tiny.tokens.index("<|im_end|>"), tiny.tokens.index("<|endoftext|>")]
    assert config["eos_token_id"] == stops
    _, tokenizer = load(str(tmp_path / "out"))
    assert set(tokenizer.eos_token_ids) == set(stops)


def test_large_models_are_written_in_shards(tmp_path, monkeypatch):
    monkeypatch.setattr("acquisition.gguf_import.SHARD_BYTES", 40_000)
    tiny, _, model, out = _import(tmp_path, "float32", arch="qwen2", tensor_type="F32")
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) > 2 and not (out / "model.safetensors").exists()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)
    reference = _logits(reference_model(tiny.config, tiny.weights))
    assert np.abs(_logits(model) - reference).max() <= 1e-5 * np.abs(reference).max()
