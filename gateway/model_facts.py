"""Facts about the served model read from its directory (config.json and safetensors
headers) on this host, for /model/info. Plain file reads: no mlx, no weights loaded."""

from __future__ import annotations

import functools
import json
import math
import struct
from pathlib import Path
from typing import Any


def _headers(directory: Path) -> dict[str, dict[str, Any]]:
    tensors: dict[str, dict[str, Any]] = {}
    for path in sorted(directory.glob("*.safetensors")):
        with path.open("rb") as handle:
            (size,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(size))
        header.pop("__metadata__", None)
        tensors.update(header)
    return tensors


def _count_parameters(tensors: dict[str, dict[str, Any]], bits: int | None) -> int:
    total = 0
    for name, entry in tensors.items():
        numel = math.prod(entry.get("shape") or [1])
        stem = name.rsplit(".", 1)[0]
        quantized = bits and f"{stem}.scales" in tensors
        if quantized and name.endswith((".scales", ".biases")):
            continue  # quantization metadata, not parameters
        if quantized and entry.get("dtype") == "U32":
            numel = numel * 32 // bits
        total += numel
    return total


@functools.lru_cache(maxsize=4)
def model_facts(directory: str) -> dict[str, Any]:
    """architecture, parameters, quantization and dtype of the model in `directory`;
    an empty dict when the directory cannot be read from here (e.g. another host)."""
    path = Path(directory)
    try:
        config = json.loads((path / "config.json").read_text())
        tensors = _headers(path)
    except (OSError, ValueError, struct.error):
        return {}
    quant = config.get("quantization") or config.get("quantization_config") or None
    bits = quant.get("bits") if isinstance(quant, dict) else None
    dtypes = sorted({entry.get("dtype", "") for entry in tensors.values()} - {"U32", ""})
    architectures = config.get("architectures") or [config.get("model_type")]
    return {
        "architecture": architectures[0],
        "parameters": _count_parameters(tensors, bits) if tensors else None,
        "quantization": (
            {"bits": bits, "group_size": quant.get("group_size")}
            if bits and isinstance(quant, dict)
            else {"bits": None, "dtype": ",".join(dtypes) or None}
        ),
    }
