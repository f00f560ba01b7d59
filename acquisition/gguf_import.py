"""Convert a GGUF file (llama, qwen2, qwen3) into an MLX model directory that mlx-lm loads.

`mx.load` reads the tensors: Q4_0, Q4_1 and Q8_0 arrive as MLX affine quantized triples
(`X.weight` uint32, `X.scales` and `X.biases` float16, group size 32), F32/F16 as they
are. BF16 is read from the file directly because `mx.load` narrows it to float16. The
header (metadata and tensor types) is parsed here, since gguf.GGUFReader takes about 2 s
on the 49k-token vocabulary of the default model.
"""

from __future__ import annotations

import json
import mmap
import struct
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import numpy as np

from acquisition.gguf_tokenizer import TokenizerImportError, build_tokenizer_files

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3")
# GGML type id -> (name, bits when quantized)
SUPPORTED_TYPES: dict[int, tuple[str, int | None]] = {
    0: ("F32", None),
    1: ("F16", None),
    30: ("BF16", None),
    8: ("Q8_0", 8),
    2: ("Q4_0", 4),
    3: ("Q4_1", 4),
}
GROUP_SIZE = 32  # every supported GGML block type holds 32 values per scale
IMPORT_DTYPES = ("quantized", "float32", "float16", "bfloat16")
SHARD_BYTES = 4 << 30

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


class GGUFImportError(ValueError):
    """The GGUF file cannot be imported; the message names what and why."""


@dataclass(frozen=True)
class TensorInfo:
    """One tensor's header entry: numpy-order shape, GGML type id, absolute file offset."""

    shape: tuple[int, ...]
    type_id: int
    offset: int

    @property
    def type_name(self) -> str:
        from gguf import GGMLQuantizationType

        try:
            return GGMLQuantizationType(self.type_id).name
        except ValueError:
            return f"type id {self.type_id}"


@dataclass(frozen=True)
class GGUFHeader:
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]


_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q"}
_SCALARS |= {11: "<q", 12: "<d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?"}
_NUMPY |= {10: "<u8", 11: "<i8", 12: "<f8"}


class _Cursor:
    def __init__(self, buffer: mmap.mmap) -> None:
        self.buffer = buffer
        self.pos = 0

    def read(self, fmt: str) -> Any:
        value = struct.unpack_from(fmt, self.buffer, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = self.read("<Q")
        text = self.buffer[self.pos : self.pos + length].decode("utf-8", errors="replace")
        self.pos += length
        return text

    def value(self, type_id: int) -> Any:
        if type_id == 8:
            return self.string()
        if type_id == 9:
            item_type, count = self.read("<I"), self.read("<Q")
            if item_type in _NUMPY:
                items = np.frombuffer(self.buffer, _NUMPY[item_type], count, self.pos).copy()
                self.pos += items.nbytes
                return items
            return [self.value(item_type) for _ in range(count)]
        return self.read(_SCALARS[type_id])


def read_header(path: Path) -> GGUFHeader:
    """Parse the GGUF header: metadata key/values and the tensor table."""
    try:
        return _parse_header(path)
    except (struct.error, ValueError, KeyError, IndexError, OverflowError) as exc:
        if isinstance(exc, GGUFImportError):
            raise
        raise GGUFImportError(f"{path} is damaged or truncated ({exc})") from None


def _parse_header(path: Path) -> GGUFHeader:
    with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        cursor = _Cursor(mm)
        if mm[:4] != b"GGUF":
            raise GGUFImportError(f"{path} is not a GGUF file (no GGUF magic)")
        cursor.pos = 4
        version = cursor.read("<I")
        if version not in (2, 3):
            raise GGUFImportError(f"{path}: GGUF version {version} is not supported (2 or 3)")
        tensor_count, kv_count = cursor.read("<Q"), cursor.read("<Q")
        metadata: dict[str, Any] = {}
        for _ in range(kv_count):
            key = cursor.string()
            metadata[key] = cursor.value(cursor.read("<I"))
        raw: list[tuple[str, tuple[int, ...], int, int]] = []
        for _ in range(tensor_count):
            name = cursor.string()
            dims = [cursor.read("<Q") for _ in range(cursor.read("<I"))]
            type_id, offset = cursor.read("<I"), cursor.read("<Q")
            raw.append((name, tuple(reversed(dims)), type_id, offset))
        alignment = int(metadata.get("general.alignment", 32))
        data_start = -(-cursor.pos // alignment) * alignment
    tensors = {name: TensorInfo(shape, t, data_start + off) for name, shape, t, off in raw}
    return GGUFHeader(metadata, tensors)


def check_supported(header: GGUFHeader, path: Path) -> str:
    """Refuse an unsupported architecture or tensor type; return the architecture."""
    arch = str(header.metadata.get("general.architecture", "?"))
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GGUFImportError(
            f"{path.name}: architecture {arch!r} is not supported; supported: "
            + ", ".join(SUPPORTED_ARCHITECTURES)
        )
    supported = ", ".join(name for name, _ in SUPPORTED_TYPES.values())
    for name, info in header.tensors.items():
        if info.type_id not in SUPPORTED_TYPES:
            raise GGUFImportError(
                f"{path.name}: tensor {name} has type {info.type_name}, which cannot be "
                f"imported; supported tensor types: {supported}"
            )
    if int(header.metadata.get("split.count", 1)) > 1:
        raise GGUFImportError(
            f"{path.name} is one part of a split GGUF; merge the parts first "
            "(llama.cpp: llama-gguf-split --merge FIRST-PART OUT.gguf)"
        )
    if "token_embd.weight" not in header.tensors:
        raise GGUFImportError(f"{path.name} holds no token_embd.weight tensor")
    if "rope_freqs.weight" in header.tensors:
        raise GGUFImportError(
            f"{path.name}: per-dimension RoPE frequencies (rope_freqs, Llama 3 RoPE scaling) "
            "are not supported"
        )
    return arch


def mlx_name(gguf_name: str) -> str:
    """Map a GGUF tensor base name (without suffix) to mlx-lm's module path."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
    raise GGUFImportError(f"tensor {gguf_name!r} has no mlx-lm counterpart")


def unpermute_rows(array: mx.array, n_heads: int) -> mx.array:
    """Undo llama.cpp's Q/K row permutation (interleaved RoPE pairs -> halves), row-wise."""
    rows = array.shape[0]
    rest = array.shape[1:]
    grouped = array.reshape(n_heads, rows // n_heads // 2, 2, *rest)
    return grouped.swapaxes(1, 2).reshape(array.shape)


def build_config(header: GGUFHeader, arch: str) -> dict[str, Any]:
    """config.json for mlx-lm from the GGUF metadata and tensor table."""
    meta = header.metadata

    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise GGUFImportError(f"GGUF metadata lacks {arch}.{key}")
        return value.item() if isinstance(value, np.generic) else value

    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    embed_rows = header.tensors["token_embd.weight"].shape[0]
    config: dict[str, Any] = {
        "model_type": arch,
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": int(get("attention.key_length", hidden // heads)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length", 4096)),
        "vocab_size": int(embed_rows),
        "tie_word_embeddings": "output.weight" not in header.tensors,
    }
    if arch == "llama" and "blk.0.attn_q.bias" in header.tensors:
        config["attention_bias"] = True
    scaling = meta.get(f"{arch}.rope.scaling.type")
    if scaling in ("linear", "yarn"):
        config["rope_scaling"] = {"type": scaling, "factor": float(get("rope.scaling.factor"))}
        if scaling == "yarn":
            original = int(get("rope.scaling.original_context_length"))
            config["rope_scaling"]["original_max_position_embeddings"] = original
    elif scaling not in (None, "none"):
        raise GGUFImportError(f"RoPE scaling type {scaling!r} is not supported")
    rope_dims = meta.get(f"{arch}.rope.dimension_count")
    if rope_dims is not None and int(rope_dims) != config["head_dim"]:
        raise GGUFImportError(
            f"partial rotary embedding ({int(rope_dims)} of {config['head_dim']} head "
            "dimensions) is not supported"
        )
    if (bos := meta.get("tokenizer.ggml.bos_token_id")) is not None:
        config["bos_token_id"] = int(bos)
    # End of turn (eot/eom) stops generation as well as end of text.
    stops = [meta.get(f"tokenizer.ggml.{key}_token_id") for key in ("eos", "eot", "eom")]
    stops = list(dict.fromkeys(int(s) for s in stops if s is not None))
    if stops:
        config["eos_token_id"] = stops[0] if len(stops) == 1 else stops
    return config


def _read_bf16(path: Path, info: TensorInfo) -> mx.array:
    count = int(np.prod(info.shape))
    data = np.fromfile(path, dtype="<u2", count=count, offset=info.offset)
    return mx.array(data.reshape(info.shape)).view(mx.bfloat16)


def _convert(
    path: Path, header: GGUFHeader, arch: str, dtype: str, float_dtype: mx.Dtype
) -> tuple[dict[str, mx.array], dict[str, tuple[int, int]]]:
    """Tensors renamed to mlx-lm keys; quantized module paths -> (bits, group size)."""
    try:
        raw = cast(dict[str, mx.array], mx.load(str(path)))
    except RuntimeError as exc:
        raise GGUFImportError(f"{path.name}: MLX cannot read the tensors ({exc})") from None
    meta = header.metadata
    heads = int(meta[f"{arch}.attention.head_count"])
    kv_heads = int(meta.get(f"{arch}.attention.head_count_kv", heads))
    keep_quantized = dtype == "quantized"
    weights: dict[str, mx.array] = {}
    quantized: dict[str, tuple[int, int]] = {}
    for key in sorted(raw):
        base, suffix = key.rsplit(".", 1)
        if suffix in ("scales", "biases"):
            continue
        info = header.tensors.get(key) or header.tensors[f"{base}.weight"]
        array = _read_bf16(path, info) if info.type_id == 30 else raw[key]
        path_name = mlx_name(base)
        bits = SUPPORTED_TYPES[info.type_id][1] if suffix == "weight" else None
        parts = {suffix: array}
        if bits is not None:
            parts |= {"scales": raw[f"{base}.scales"], "biases": raw[f"{base}.biases"]}
        if arch == "llama" and base.endswith((".attn_q", ".attn_k")):
            n = heads if base.endswith(".attn_q") else kv_heads
            parts = {name: unpermute_rows(value, n) for name, value in parts.items()}
        if bits is not None and keep_quantized:
            quantized[path_name] = (bits, GROUP_SIZE)
            parts["scales"] = parts["scales"].astype(float_dtype)
            parts["biases"] = parts["biases"].astype(float_dtype)
        elif bits is not None:
            scales, biases = (parts[k].astype(mx.float32) for k in ("scales", "biases"))
            weight = mx.dequantize(
                parts["weight"], scales, biases, group_size=GROUP_SIZE, bits=bits
            )
            parts = {"weight": weight.astype(float_dtype)}
        else:
            parts = {name: value.astype(float_dtype) for name, value in parts.items()}
        for name, value in parts.items():
            weights[f"{path_name}.{name}"] = value
    return weights, quantized


def _quantization_config(quantized: dict[str, tuple[int, int]]) -> dict[str, Any]:
    """Top-level default = the most common (bits, group); other layers named one by one."""
    (bits, group), _ = Counter(quantized.values()).most_common(1)[0]
    config: dict[str, Any] = {"group_size": group, "bits": bits}
    for path_name, (layer_bits, layer_group) in sorted(quantized.items()):
        if (layer_bits, layer_group) != (bits, group):
            config[path_name] = {"group_size": layer_group, "bits": layer_bits}
    return config


def _save_weights(weights: dict[str, mx.array], out_dir: Path) -> None:
    shards: list[dict[str, mx.array]] = [{}]
    size = 0
    for key, value in weights.items():
        if size and size + value.nbytes > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][key] = value
        size += value.nbytes
    if len(shards) == 1:
        mx.save_safetensors(str(out_dir / "model.safetensors"), shards[0], {"format": "mlx"})
        return
    index: dict[str, Any] = {"metadata": {}, "weight_map": {}}
    for number, shard in enumerate(shards, start=1):
        name = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        mx.save_safetensors(str(out_dir / name), shard, {"format": "mlx"})
        index["weight_map"] |= {key: name for key in shard}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def import_gguf(
    path: Path, out_dir: Path, dtype: str = "quantized", float_dtype: str = "float16"
) -> dict[str, Any]:
    """Write config.json, safetensors and tokenizer files for `path` into `out_dir`.

    dtype: "quantized" keeps Q4_0/Q4_1/Q8_0 as MLX affine quantized weights, with their
    scales, biases and every float tensor in `float_dtype` (float16 suits Metal; MLX's
    CPU is about 25x faster with float32); a float dtype dequantizes everything to it.
    Returns the written config.
    """
    if dtype not in IMPORT_DTYPES:
        raise GGUFImportError(f"import dtype {dtype!r} is not one of {', '.join(IMPORT_DTYPES)}")
    header = read_header(path)
    arch = check_supported(header, path)
    config = build_config(header, arch)
    try:
        tokenizer_json, tokenizer_config = build_tokenizer_files(
            header.metadata, config["max_position_embeddings"]
        )
    except TokenizerImportError as exc:
        raise GGUFImportError(f"{path.name}: {exc}") from None
    float_type = getattr(mx, float_dtype if dtype == "quantized" else dtype)
    weights, quantized = _convert(path, header, arch, dtype, float_type)
    if quantized:
        config["quantization"] = _quantization_config(quantized)
    out_dir.mkdir(parents=True, exist_ok=True)
    _save_weights(weights, out_dir)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    (out_dir / "tokenizer.json").write_text(json.dumps(tokenizer_json, ensure_ascii=False))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    return config
