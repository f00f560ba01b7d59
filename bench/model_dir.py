"""Write a bench model directory: a model's files with a config (and weights) of its own,
and the index of which file holds each weight that mlx-lm's sharded_load reads (a 2-rank
mlx_lm.server loads through it); written beside the destination and renamed into place,
so a half-written directory is never taken for a model."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx


def write_model_dir(
    src: Path,
    dst: Path,
    config: dict,
    weights: dict[str, mx.array] | None = None,
    files: tuple[str, ...] | None = None,
) -> Path:
    """`src`'s files (only `files` where given) at `dst` with `config` and, where given,
    `weights` (one file in place of src's); returns `dst`."""
    tmp = dst.with_name(dst.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    names: dict[str, str] = {}
    if weights is not None:
        mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
        names = dict.fromkeys(weights, "model.safetensors")
    for file in sorted(src.iterdir()):
        if not file.is_file() or file.name == "config.json":
            continue
        if files is not None and file.name not in files:
            continue
        if file.suffix == ".safetensors":
            if weights is not None:
                continue
            names |= dict.fromkeys(mx.load(str(file)), file.name)
        shutil.copy2(file, tmp / file.name)
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    index = {"metadata": {}, "weight_map": dict(sorted(names.items()))}
    (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    tmp.rename(dst)
    return dst
