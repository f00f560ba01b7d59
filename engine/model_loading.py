"""Load this rank's model: the split planner + sharded loader when present, else replicated.

The replicated fallback loads the full model on every rank (correct lock-step, no
memory saving); it disappears once `distributed.plan` and `distributed.loader` exist.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

from config import Settings

log = logging.getLogger("ring.model")


class ModelLoadError(Exception):
    """The model cannot be resolved, planned or loaded; the message says why."""


@dataclass
class ModelInfo:
    """What status reports about the loaded model."""

    model_id: str
    path: str
    config: dict
    plan: dict = field(default_factory=dict)
    share: str = "full model (replicated)"
    weight_bytes: int = 0


def resolve_model_dir(settings: Settings) -> Path:
    """MODEL as an MLX directory: engine.model_source when present, else a local path."""
    try:
        from engine.model_source import ModelSourceError, resolve_model
    except ImportError:
        path = Path(settings.model).expanduser()
        if not (path / "config.json").is_file():
            raise SystemExit(
                f"error: MODEL={settings.model!r} is not a local MLX model directory "
                "(config.json missing) and engine.model_source is not available"
            ) from None
        return path
    try:
        return Path(resolve_model(settings))
    except ModelSourceError as exc:
        raise ModelLoadError(str(exc)) from None


def load_for_rank(settings: Settings, group: mx.distributed.Group) -> tuple[Any, Any, ModelInfo]:
    """(model, tokenizer or None off rank 0, info). Every rank calls this in lock-step."""
    from mlx_lm.utils import load_model, load_tokenizer

    model_dir = resolve_model_dir(settings)
    config = json.loads((model_dir / "config.json").read_text())
    info = ModelInfo(model_id=settings.model or model_dir.name, path=str(model_dir), config=config)
    try:
        if os.environ.get("RING_REPLICATED") == "1":
            raise ImportError("replicated loading forced by RING_REPLICATED=1")
        from distributed.loader import load_rank_model, resolve_weights, weight_bytes
        from distributed.plan import PlanError, make_plan
    except ImportError:
        model, _ = load_model(model_dir, lazy=False)
        info.weight_bytes = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
        log.info("loaded the full model from %s (replicated; no split planner yet)", model_dir)
    else:
        try:
            weights = resolve_weights(settings.rank_weights, group)
            plan = make_plan(config, group.size(), weights, settings.parallelism)
        except PlanError as exc:
            message = f"cannot split the model over {group.size()} ranks: {exc}"
            raise ModelLoadError(message) from None
        model = load_rank_model(model_dir, group, plan)
        info.plan = plan.model_dump(mode="json")
        info.share = plan.describe()[1 + group.rank()].strip()
        info.weight_bytes = weight_bytes(model)
    tokenizer = load_tokenizer(model_dir) if group.rank() == 0 else None
    return model, tokenizer, info
