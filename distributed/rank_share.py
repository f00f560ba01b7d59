"""One rank's share of a model as files of its own: what the first host sends a worker
(launcher/model_sender.py) and how that worker's rank loads it.

The share is exactly what the loader would hold: the first host loads the model lazily,
runs the loader's own split (distributed/splitting.py) for the worker's rank with a
stand-in group, and writes the parameters that remain, under their names in the split
model, into safetensors files (each parameter whole: a head slice, a column slice, an
expert range, a pipeline stage's layers). Beside them travel config.json, the tokenizer and
the other small files of the model directory, the checkpoint's own tensor layout (names,
shapes, dtypes: layout.json) and share-meta.json (the model, the plan and the rank).

The worker rebuilds the model's structure without its weights: mlx-lm's own load (config,
sanitize, quantization) runs over placeholders shaped like the checkpoint's tensors, which
are never evaluated, and the same split cuts that structure. The share's arrays then
replace every parameter; a name, shape or dtype that differs, or a share made for another
plan, model or rank, is refused before anything is evaluated.
"""

from __future__ import annotations

import hashlib
import json
import logging
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.utils import _get_classes, load_model

from distributed.model_shape import PlanError
from distributed.plan import Plan
from distributed.plan_text import describe
from distributed.splitting import Progress, StandInGroup, materialize, parameters, split_model

log = logging.getLogger("ring.plan")

SHARE_FORMAT = 1  # bump when the files a share holds change, so old shares are sent again
LAYOUT_FILE = "layout.json"
META_FILE = "share-meta.json"
TENSOR_FILE = "share-{index:05d}.safetensors"
# Tensor files of at most this many bytes (or one parameter, if larger): mlx-lm's own
# checkpoints shard at 5 GB; smaller files keep a damaged file's reload small too.
MAX_FILE_BYTES = 2 << 30
# safetensors dtype names <-> MLX dtypes (fp8 checkpoints load as bytes, as MLX keeps them)
SAFETENSORS_DTYPES: dict[str, mx.Dtype] = {
    "F32": mx.float32,
    "F16": mx.float16,
    "BF16": mx.bfloat16,
    "F64": mx.float64,
    "I8": mx.int8,
    "I16": mx.int16,
    "I32": mx.int32,
    "I64": mx.int64,
    "U8": mx.uint8,
    "U16": mx.uint16,
    "U32": mx.uint32,
    "U64": mx.uint64,
    "BOOL": mx.bool_,
    "C64": mx.complex64,
    "F8_E4M3": mx.uint8,
    "F8_E5M2": mx.uint8,
}
_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items() if not name.startswith("F8")}

Layout = dict[str, tuple[str, list[int]]]  # checkpoint tensor -> (safetensors dtype, shape)


class ShareMismatch(PlanError):
    """A share that does not hold what this rank must load; the message says what differs."""


# ---- what identifies a share -------------------------------------------------------------


def share_key(model_key: str, plan: Plan, rank: int) -> str:
    """The name of `rank`'s share of the model `model_key` under `plan` (and this format)."""
    text = json.dumps([SHARE_FORMAT, model_key, plan.identity(), rank], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


# ---- the first host: the share's tensors ---------------------------------------------------


def checkpoint_layout(model_dir: Path) -> Layout:
    """Every tensor of the checkpoint files mlx-lm loads (model*.safetensors), from their
    headers alone."""
    layout: Layout = {}
    for file in sorted(Path(model_dir).glob("model*.safetensors")):
        with open(file, "rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(length))
        header.pop("__metadata__", None)
        layout |= {name: (info["dtype"], list(info["shape"])) for name, info in header.items()}
    return layout


def rank_parameters(model_dir: Path, plan: Plan, rank: int) -> list[tuple[str, mx.array]]:
    """`rank`'s parameters under `plan`, lazy (nothing is read until each is evaluated)."""
    model, _ = load_model(Path(model_dir), lazy=True)
    group = StandInGroup(rank, plan.world_size)
    return parameters(split_model(model, plan, group))  # type: ignore[arg-type]


def dtype_name(dtype: mx.Dtype) -> str:
    if dtype not in _NAMES:
        raise ValueError(f"no safetensors name for {dtype}")
    return _NAMES[dtype]


def file_groups(arrays: list[tuple[str, mx.array]]) -> list[list[tuple[str, mx.array]]]:
    """The parameters in files of at most MAX_FILE_BYTES, in order."""
    files: list[list[tuple[str, mx.array]]] = [[]]
    size = 0
    for name, array in arrays:
        if files[-1] and size + array.nbytes > MAX_FILE_BYTES:
            files.append([])
            size = 0
        files[-1].append((name, array))
        size += array.nbytes
    return [group for group in files if group]


def safetensors_header(arrays: list[tuple[str, mx.array]]) -> bytes:
    """The 8-byte length and JSON header of a safetensors file holding `arrays` in order
    (padded with spaces to 8 bytes, as the format allows)."""
    entries: dict[str, Any] = {"__metadata__": {"format": "mlx"}}
    offset = 0
    for name, array in arrays:
        end = offset + array.nbytes
        entries[name] = {
            "dtype": dtype_name(array.dtype),
            "shape": list(array.shape),
            "data_offsets": [offset, end],
        }
        offset = end
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


# ---- the worker: loading a share -----------------------------------------------------------


def _shell(placeholders: dict[str, mx.array]) -> Callable[[dict], tuple[Callable, type]]:
    """mlx-lm's model classes, with the model's sanitize fed the placeholders instead of
    the (absent) checkpoint: mlx-lm's load then builds the very structure it builds on the
    first host (renames, stacked experts, quantized layers), from shapes alone."""

    def classes(config: dict) -> tuple[Callable, type]:
        model_class, args_class = _get_classes(config)

        def build(args: Any) -> nn.Module:
            model = model_class(args)
            own = getattr(model, "sanitize", None)
            model.sanitize = lambda _weights: own(dict(placeholders)) if own else placeholders
            return model

        return build, args_class

    return classes


def _placeholders(layout: Layout) -> dict[str, mx.array]:
    return {
        name: mx.zeros(shape, dtype=SAFETENSORS_DTYPES[dtype])
        for name, (dtype, shape) in layout.items()
    }


def read_meta(share_dir: Path) -> dict[str, Any]:
    return json.loads((Path(share_dir) / META_FILE).read_text())


def check_meta(meta: dict[str, Any], model_key: str, plan: Plan, rank: int) -> None:
    """Refuse a share made for another model, split or rank, naming both splits."""
    if meta.get("format") != SHARE_FORMAT:
        raise ShareMismatch(f"the share has format {meta.get('format')}, not {SHARE_FORMAT}")
    if meta.get("model_key") != model_key:
        raise ShareMismatch(
            f"the share is of model {meta.get('model_key')}, the cluster serves {model_key}"
        )
    if meta.get("share_key") != share_key(model_key, plan, rank) or meta.get("rank") != rank:
        made = Plan.model_validate(meta["plan"])
        raise ShareMismatch(
            f"the share was made for rank {meta.get('rank')} of this split: "
            f"{' | '.join(line.strip() for line in describe(made))}; the ranks planned rank "
            f"{rank} of: {' | '.join(line.strip() for line in describe(plan))}"
        )


def _check_arrays(expected: dict[str, mx.array], held: dict[str, mx.array]) -> None:
    missing = sorted(set(expected) - set(held))
    extra = sorted(set(held) - set(expected))
    if missing or extra:
        raise ShareMismatch(
            f"the share's tensors are not this rank's: {len(missing)} missing "
            f"({', '.join(missing[:3])}), {len(extra)} not expected ({', '.join(extra[:3])})"
        )
    for name, want in expected.items():
        got = held[name]
        if tuple(got.shape) != tuple(want.shape) or got.dtype != want.dtype:
            raise ShareMismatch(
                f"the share's {name} is {got.dtype} {tuple(got.shape)}, this rank needs "
                f"{want.dtype} {tuple(want.shape)}"
            )


def load_share(
    share_dir: Path,
    plan: Plan,
    group: mx.distributed.Group,
    model_key: str,
    progress: Progress | None = None,
) -> nn.Module:
    """This rank's part of the model from its share in `share_dir`, evaluated; raises
    ShareMismatch (before evaluating anything) when the share is not what `plan` gives it."""
    share_dir = Path(share_dir)
    check_meta(read_meta(share_dir), model_key, plan, group.rank())
    layout_text = json.loads((share_dir / LAYOUT_FILE).read_text())
    layout: Layout = {name: (dtype, shape) for name, (dtype, shape) in layout_text.items()}
    model, _ = load_model(
        share_dir, lazy=True, strict=False, get_model_classes=_shell(_placeholders(layout))
    )
    model = split_model(model, plan, group)
    held: dict[str, mx.array] = {}
    for file in sorted(share_dir.glob("share-*.safetensors")):
        held |= mx.load(str(file))  # type: ignore[arg-type]
    _check_arrays(dict(parameters(model)), held)
    model.load_weights(list(held.items()), strict=True)
    materialize(model, progress)
    return model
