"""Split planner: which KV-head groups, query heads, MLP columns and layers each rank holds.

`make_plan` reads only the model config, so a split that cannot be honoured is refused
(with the reason and the alternatives that would work) before any weight loads.
Shares follow the rank weights by the largest-remainder method, at least one unit per rank.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Literal

from pydantic import BaseModel

from config.settings import Parallelism, RankWeights, parse_rank_weights
from distributed.hosts import RankHost, crowded_host, this_host
from distributed.model_shape import SUPPORTED_FAMILIES, ModelShape, PlanError

__all__ = ["ModelShape", "Plan", "PlanError", "RankShare", "apportion", "make_plan"]

Strategy = Literal["single", "tensor-even", "tensor-uneven", "pipeline"]


class RankShare(BaseModel):
    """One rank's part. Ranges are [start, end) in units of heads, columns or layers."""

    rank: int
    weight: float
    kv_heads: tuple[int, int]
    q_heads: tuple[int, int]
    mlp_columns: tuple[int, int]
    layers: tuple[int, int]
    embeddings: bool
    head: bool


class Plan(BaseModel):
    """The whole split; `model_dump()` is what /cluster/status shows."""

    strategy: Strategy
    requested: Parallelism
    world_size: int
    weights: list[float]
    shape: ModelShape
    ranks: list[RankShare]
    note: str = ""  # why auto chose this strategy, when it is not the first choice

    @property
    def is_tensor(self) -> bool:
        return self.strategy in ("tensor-even", "tensor-uneven")

    def describe(self) -> list[str]:
        """One headline plus one line per rank, for logs and the CLI."""
        s = self.shape
        quant = f"{s.bits}-bit, group {s.group_size}" if s.quantized else "float"
        lines = [
            f"plan {self.strategy} (asked {self.requested}) for {s.model_type} on "
            f"{self.world_size} rank(s), weights {','.join(f'{w:g}' for w in self.weights)}: "
            f"{s.num_heads} q / {s.num_kv_heads} kv heads x {s.head_dim}, mlp "
            f"{s.intermediate_size}, {s.num_layers} layers, {quant}"
        ]
        if self.note:
            lines[0] += f"; {self.note}"
        for r in self.ranks:
            if self.is_tensor:
                body = (
                    f"kv heads {_span(r.kv_heads)}, q heads {_span(r.q_heads)}, "
                    f"mlp columns {_span(r.mlp_columns)}, all {s.num_layers} layers"
                )
            else:
                body = f"layers {_span(r.layers)}"
            head = "head"
            if not self.is_tensor and s.tie_word_embeddings and self.world_size > 1:
                head = "tied head (on the final hidden state from the last stage)"
            final_norm = not self.is_tensor and r.rank == self.world_size - 1
            parts = (("embeddings", r.embeddings), ("final norm", final_norm), (head, r.head))
            extras = [name for name, on in parts if on]
            if extras:
                body += " + " + " + ".join(extras)
            lines.append(f"  rank {r.rank} (weight {r.weight:g}): {body}")
        return lines


def _span(span: tuple[int, int]) -> str:
    start, end = span
    return f"{start}-{end - 1} ({end - start})" if end - start != 1 else f"{start} (1)"


def apportion(total: int, weights: list[float]) -> list[int]:
    """Split `total` units by weight: largest remainder, then at least one unit per rank."""
    if total < len(weights):
        raise ValueError(f"cannot give {len(weights)} ranks at least one of {total} units")
    scale = total / sum(weights)
    ideal = [w * scale for w in weights]
    shares = [math.floor(x) for x in ideal]
    by_remainder = sorted(range(len(weights)), key=lambda i: (-(ideal[i] - shares[i]), i))
    for i in by_remainder[: total - sum(shares)]:
        shares[i] += 1
    for i in range(len(shares)):
        if shares[i] == 0:
            donor = max(
                (j for j in range(len(shares)) if shares[j] > 1),
                key=lambda j: (shares[j] - ideal[j], -j),
            )
            shares[donor] -= 1
            shares[i] = 1
    return shares


def _ranges(shares: list[int], unit: int = 1) -> list[tuple[int, int]]:
    out, start = [], 0
    for share in shares:
        out.append((start * unit, (start + share) * unit))
        start += share
    return out


def _tensor_problems(shape: ModelShape, world: int, weights: list[float]) -> list[str]:
    """Reasons a tensor split cannot be honoured (empty when it can)."""
    problems = []
    if shape.num_heads % shape.num_kv_heads:
        problems.append(
            f"{shape.num_heads} query heads do not group evenly over {shape.num_kv_heads} KV heads"
        )
    if world > shape.num_kv_heads:
        problems.append(
            f"tensor parallel gives each rank whole KV heads: the model has "
            f"{shape.num_kv_heads} KV heads, fewer than {world} ranks"
        )
    unit = shape.mlp_unit
    if shape.intermediate_size % unit:
        problems.append(
            f"intermediate size {shape.intermediate_size} is not a whole number of "
            f"quantization groups of {unit}"
        )
    elif shape.intermediate_size // unit < world:
        problems.append(
            f"{shape.intermediate_size // unit} MLP units of {unit} columns, "
            f"fewer than {world} ranks"
        )
    if problems or not shape.quantized:
        return problems
    per_kv = shape.num_heads // shape.num_kv_heads * shape.head_dim
    for start, _ in _ranges(apportion(shape.num_kv_heads, weights))[1:]:
        column = start * per_kv
        if column % unit:
            problems.append(
                f"the o_proj split at input column {column} would cut a quantization group "
                f"of {unit} ({per_kv} columns per KV-head group)"
            )
            break
    return problems


def _pipeline_problems(shape: ModelShape, world: int) -> list[str]:
    if world > shape.num_layers:
        return [f"pipeline gives each rank whole layers: {shape.num_layers} layers, {world} ranks"]
    return []


def _is_even(shape: ModelShape, world: int, weights: list[float]) -> bool:
    if len(set(weights)) != 1:
        return False
    counts = (shape.num_kv_heads, shape.num_heads, shape.intermediate_size)
    if any(count % world for count in counts):
        return False
    if shape.quantized:
        unit = shape.mlp_unit
        per_rank = (shape.intermediate_size // world, shape.num_heads * shape.head_dim // world)
        return all(cols % unit == 0 for cols in per_rank)
    return True


def _alternatives(shape: ModelShape, world: int, weights: list[float], failed: str) -> list[str]:
    """What would work instead, for the refusal message."""
    out = []
    if failed != "tensor" and not _tensor_problems(shape, world, weights):
        out.append(f"PARALLELISM=tensor works with {world} ranks")
    if failed != "pipeline" and not _pipeline_problems(shape, world):
        out.append(f"PARALLELISM=pipeline works with {world} ranks")
    if failed == "tensor":
        fits = [n for n in range(2, world) if not _tensor_problems(shape, n, [1.0] * n)]
        if fits:
            out.append(f"tensor parallel works with NUM_DEVICES in {fits} (equal weights)")
    elif failed == "pipeline":
        out.append(f"pipeline works with at most {shape.num_layers} ranks")
    out.append("NUM_DEVICES=1 always works if the model fits one machine")
    return out


def _refuse(reasons: list[str], alternatives: list[str]) -> PlanError:
    return PlanError("; ".join(reasons) + ". What would work: " + "; ".join(alternatives))


def _check_weights(world_size: int, weights: list[float] | None) -> list[float]:
    if weights is None:
        return [1.0] * world_size
    weights = [float(w) for w in weights]
    if len(weights) != world_size:
        raise PlanError(
            f"{len(weights)} rank weights given for {world_size} ranks; give exactly one "
            f"positive weight per rank (e.g. RANK_WEIGHTS={','.join(['1'] * world_size)}) "
            "or none for equal shares"
        )
    if not all(math.isfinite(w) and w > 0 for w in weights):
        raise PlanError(f"rank weights {weights} must all be positive numbers, e.g. 2,1,1")
    return weights


def resolve_weights(spec: RankWeights, hosts: list[RankHost]) -> list[float] | None:
    """RANK_WEIGHTS as the planner takes it: None (equal), by memory for `auto`, or as given."""
    if spec == "auto":
        return [host.memory_bytes / 2**30 for host in hosts]
    return spec


def make_plan(
    config: dict,
    world_size: int,
    weights: list[float] | None,
    parallelism: str = "auto",
    hosts: list[RankHost] | None = None,
) -> Plan:
    """Plan the split of `config`'s model over `world_size` ranks, or raise PlanError.

    `hosts` (one per rank) lets `auto` see ranks that share a machine's cores.
    """
    if world_size < 1:
        raise PlanError(f"world size {world_size} must be at least 1")
    if parallelism not in ("auto", "tensor", "pipeline"):
        raise PlanError(f"PARALLELISM={parallelism!r} must be one of auto, tensor, pipeline")
    weights = _check_weights(world_size, weights)
    shape = ModelShape.from_config(config)
    layers_all = (0, shape.num_layers)
    if world_size == 1:
        share = RankShare(
            rank=0,
            weight=weights[0],
            kv_heads=(0, shape.num_kv_heads),
            q_heads=(0, shape.num_heads),
            mlp_columns=(0, shape.intermediate_size),
            layers=layers_all,
            embeddings=True,
            head=True,
        )
        return Plan(
            strategy="single",
            requested=parallelism,
            world_size=1,
            weights=weights,
            shape=shape,
            ranks=[share],
        )
    if shape.family not in SUPPORTED_FAMILIES:
        raise PlanError(
            f"model type {shape.model_type!r} cannot be split: tensor and pipeline "
            f"parallelism support {', '.join(SUPPORTED_FAMILIES)}. What would work: NUM_DEVICES=1"
        )
    tensor_problems = _tensor_problems(shape, world_size, weights)
    pipeline_problems = _pipeline_problems(shape, world_size)
    if parallelism == "tensor" and tensor_problems:
        raise _refuse(tensor_problems, _alternatives(shape, world_size, weights, "tensor"))
    if parallelism == "pipeline" and pipeline_problems:
        raise _refuse(pipeline_problems, _alternatives(shape, world_size, weights, "pipeline"))
    if parallelism == "auto" and tensor_problems and pipeline_problems:
        raise _refuse(
            tensor_problems + pipeline_problems,
            _alternatives(shape, world_size, weights, "both"),
        )
    use_tensor = parallelism == "tensor" or (parallelism == "auto" and not tensor_problems)
    crowded = crowded_host(hosts) if hosts and parallelism == "auto" else None
    if use_tensor and crowded and not pipeline_problems:
        # Ranks that take turns on the cores wait for each other twice a layer in tensor
        # parallel: a decode step of the default model took 428 ms with 3 local ranks on
        # 2 cores, 124 ms pipeline parallel.
        name, count, cores = crowded
        plan = _pipeline_plan(shape, world_size, weights, parallelism)
        plan.note = (
            f"{count} local ranks on {cores} cores of {name}: pipeline parallel "
            "(PARALLELISM=tensor to override)"
        )
        return plan
    if use_tensor:
        return _tensor_plan(shape, world_size, weights, parallelism)
    return _pipeline_plan(shape, world_size, weights, parallelism)


def _tensor_plan(shape: ModelShape, world: int, weights: list[float], asked: str) -> Plan:
    group = shape.num_heads // shape.num_kv_heads
    kv = _ranges(apportion(shape.num_kv_heads, weights))
    unit = shape.mlp_unit
    mlp = _ranges(apportion(shape.intermediate_size // unit, weights), unit)
    ranks = [
        RankShare(
            rank=r,
            weight=weights[r],
            kv_heads=kv[r],
            q_heads=(kv[r][0] * group, kv[r][1] * group),
            mlp_columns=mlp[r],
            layers=(0, shape.num_layers),
            embeddings=True,
            head=True,
        )
        for r in range(world)
    ]
    strategy = "tensor-even" if _is_even(shape, world, weights) else "tensor-uneven"
    return Plan(
        strategy=strategy,
        requested=asked,
        world_size=world,
        weights=weights,
        shape=shape,
        ranks=ranks,
    )


def _pipeline_plan(shape: ModelShape, world: int, weights: list[float], asked: str) -> Plan:
    layers = _ranges(apportion(shape.num_layers, weights))
    last = world - 1
    # A tied head is the embedding matrix, which rank 0 already holds: it applies the head
    # to the final hidden state the last stage sends back, so nothing is stored twice.
    head_rank = 0 if shape.tie_word_embeddings else last
    ranks = [
        RankShare(
            rank=r,
            weight=weights[r],
            kv_heads=(0, shape.num_kv_heads),
            q_heads=(0, shape.num_heads),
            mlp_columns=(0, shape.intermediate_size),
            layers=layers[r],
            embeddings=r == 0,
            head=r == head_rank,
        )
        for r in range(world)
    ]
    return Plan(
        strategy="pipeline",
        requested=asked,
        world_size=world,
        weights=weights,
        shape=shape,
        ranks=ranks,
    )


def _config_for(model: str) -> dict:
    path = Path(model)
    if (path / "config.json").is_file():
        return json.loads((path / "config.json").read_text())
    # Not an MLX directory: let the model resolver import or download it.
    from acquisition.source import resolve_model
    from config.settings import load_settings

    directory = resolve_model(load_settings(model=model))
    return json.loads((Path(directory) / "config.json").read_text())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Print the split plan for a model.")
    parser.add_argument("--model", required=True, help="MLX model directory (or MODEL value)")
    parser.add_argument("--world", type=int, required=True, help="number of ranks")
    parser.add_argument("--weights", default="", help="per-rank weights, e.g. 2,1,1")
    parser.add_argument("--parallelism", default="auto", choices=["auto", "tensor", "pipeline"])
    parser.add_argument(
        "--local", action="store_true", help="every rank on this machine (it may lack cores)"
    )
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    args = parser.parse_args(argv)
    hosts = [this_host()] * args.world if args.local else None
    try:
        spec = parse_rank_weights(args.weights)
        if spec == "auto" and hosts is None:
            raise PlanError("weights 'auto' need the hosts' memory: add --local")
        weights = resolve_weights(spec, hosts or [])
        plan = make_plan(_config_for(args.model), args.world, weights, args.parallelism, hosts)
    except (PlanError, ValueError) as exc:
        print(f"refused: {exc}", file=sys.stderr)
        return 2
    print(plan.model_dump_json(indent=2) if args.json else "\n".join(plan.describe()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
