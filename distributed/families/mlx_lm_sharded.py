"""Families we split through mlx-lm's own Model.shard(): even tensor parallel only."""

from __future__ import annotations

from distributed.families.spec import Family

FAMILIES: tuple[Family, ...] = ()
