"""`python -m distributed.plan_cli`: print the split plan for a model (no memory check; for
that, `./launch.sh plan`, launcher/plan_check.py)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from config.settings import parse_rank_weights
from distributed.hosts import this_host
from distributed.model_shape import PlanError
from distributed.plan import make_plan, resolve_weights
from distributed.plan_text import describe


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
    print(plan.model_dump_json(indent=2) if args.json else "\n".join(describe(plan)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
