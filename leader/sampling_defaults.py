"""Sampling values for requests that set none: the model's generation_config.json when it
has them, else the DEFAULT_* settings (temperature 0: greedy, as mlx_lm.server answers).

Rank 0 fills them into each request's SamplingParams before its sampler is built.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from config.settings import Settings
from ipc.protocol import SamplingParams

log = logging.getLogger("ring.scheduler")

# generation_config.json key -> (accepted when, type)
_CHECKS: dict[str, tuple[Any, type]] = {
    "temperature": (lambda v: 0 <= v <= 2, float),
    "top_p": (lambda v: 0 < v <= 1, float),
    "top_k": (lambda v: v >= 0, int),
    "min_p": (lambda v: 0 <= v <= 1, float),
}


@dataclass(frozen=True)
class SamplingDefaults:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    source: str = "settings"

    @classmethod
    def load(cls, model_dir: Path | None, settings: Settings) -> SamplingDefaults:
        """DEFAULT_TEMPERATURE and friends, overridden by what generation_config.json in
        `model_dir` says (do_sample false means greedy)."""
        base = cls(
            temperature=settings.default_temperature,
            top_p=settings.default_top_p,
            top_k=settings.default_top_k,
            min_p=settings.default_min_p,
        )
        if model_dir is None:
            return base
        path = Path(model_dir) / "generation_config.json"
        try:
            config = json.loads(path.read_text())
        except FileNotFoundError:
            return base
        except (OSError, ValueError) as exc:
            log.warning("ignoring %s: %s", path, exc)
            return base
        return base.updated_from(config if isinstance(config, dict) else {})

    def updated_from(self, config: dict[str, Any]) -> SamplingDefaults:
        """These defaults with generation_config.json's valid sampling values on top."""
        found: dict[str, Any] = {}
        for key, (accept, kind) in _CHECKS.items():
            value = config.get(key)
            if value is None or isinstance(value, bool) or not isinstance(value, int | float):
                continue
            if kind is int and value != int(value):
                continue
            if accept(value):
                found[key] = kind(value)
            else:
                log.warning("ignoring generation_config.json's %s=%r (out of range)", key, value)
        if config.get("do_sample") is False:
            found["temperature"] = 0.0
        if not found:
            return self
        return replace(self, **found, source="generation_config.json")

    def resolve(self, params: SamplingParams) -> SamplingParams:
        """`params` with every value the request left unset taken from these defaults."""
        unset = {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if f.name in _CHECKS and getattr(params, f.name) is None
        }
        return params.model_copy(update=unset) if unset else params

    def describe(self) -> str:
        return (
            f"temperature {self.temperature:g}, top_p {self.top_p:g}, top_k {self.top_k}, "
            f"min_p {self.min_p:g} ({self.source})"
        )
