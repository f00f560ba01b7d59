"""The family registry: every model family the ranks can split, one module per family (or
group), each defining FAMILY the same way (distributed/families/spec.py).

A model type absent from here still runs on one rank; splitting it is refused by name.
docs/MODELS.md is generated from this registry (tests/test_families.py keeps it in step).
"""

from __future__ import annotations

from distributed.families import (
    deepseek_v2,
    deepseek_v3,
    glm4_moe,
    gpt_oss,
    llama,
    minimax,
    mixtral,
    mlx_lm_sharded,
    qwen2,
    qwen3,
    qwen3_moe,
)
from distributed.families.spec import Family

FAMILIES: tuple[Family, ...] = (
    llama.FAMILY,
    qwen2.FAMILY,
    qwen3.FAMILY,
    qwen3_moe.FAMILY,
    mixtral.FAMILY,
    deepseek_v2.FAMILY,
    deepseek_v3.FAMILY,
    glm4_moe.FAMILY,
    gpt_oss.FAMILY,
    minimax.FAMILY,
    *mlx_lm_sharded.FAMILIES,
)

_BY_TYPE = {model_type: family for family in FAMILIES for model_type in family.model_types}


def registered(model_type: str) -> Family | None:
    """The family of `model_type`, or None when the registry lacks it."""
    return _BY_TYPE.get(model_type)


def model_types() -> list[str]:
    return sorted(_BY_TYPE)
