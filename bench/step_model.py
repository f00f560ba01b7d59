"""docs/BENCHMARKS.md's table of the step-time model against this machine: predicted and
measured decode (1 and 8 clients) and prefill, from bench/step_time.py's reports.

    .venv/bin/python -m bench.step_model run/bench/r-*.json [--again]

Each report carries the cluster's own figures: the medians of its measured steps, the
model's predictions for the same steps (made in the server, from the rates and link the
ranks measured at start), and what they were made from (the plan, every rank's machine
record, the link, the steps' contexts, the prefill's forwards). `--again` predicts once
more from those records with this checkout's distributed/step_model.py, so a change of
the model is checked against the measurements already taken.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from distributed.plan import Plan
from distributed.speed_records import speed_from_record
from distributed.step_model import ClusterModel
from distributed.step_work import plan_work


def model_of(report: dict[str, Any]) -> ClusterModel:
    """The cluster's step-time model, rebuilt from its report."""
    speed = report["model"]["speed"]
    plan = Plan.model_validate(report["plan"])
    work = plan_work(plan, int(speed["activation_bytes"]), speed["kv_bytes_per_token"])
    work = work.calibrated([int(b) for b in speed["weight_bytes"]])
    return ClusterModel(work, speed_from_record(speed))


def figures(report: dict[str, Any], again: bool) -> dict[str, tuple[float, float]]:
    """{"decode 1": (predicted, measured) ms, "decode 8": ..., "prefill": tok/s both}."""
    status = report["model"]
    model = model_of(report) if again else None
    out: dict[str, tuple[float, float]] = {}
    for rows, measured in status["measured_decode_ms"].items():
        predicted = status["predicted_decode_ms"][rows]
        if model is not None:
            predicted = model.decode_ms(int(rows), 1, status["decode_context"][rows])
        out[f"decode {rows}"] = (predicted, measured)
    forwards = status.get("prefill_forwards") or []
    if forwards:
        pieces = [p for step, _ in forwards for p in step]
        tokens = sum(count for _, count in pieces)
        ms = sum(took for _, took in forwards)
        if model is not None:
            predicted = 1000 * tokens / sum(model.prefill_ms(c, ctx) for ctx, c in pieces if c)
        else:
            predicted = status["predicted_prefill_tokens_per_s"]
        out["prefill"] = (predicted, 1000 * tokens / ms)
    return out


def _cell(pair: tuple[float, float] | None, unit: str) -> str:
    if pair is None:
        return "-"
    predicted, measured = pair
    return f"{predicted:.1f} / {measured:.1f} {unit} ({(predicted - measured) / measured:+.0%})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("reports", type=Path, nargs="+")
    parser.add_argument("--again", action="store_true", help="predict again from the records")
    args = parser.parse_args()
    print(
        "| run | model | ranks | plan | link (measured at start) | decode step, 1 client: "
        "predicted / measured | 8 clients | prefill tok/s |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for path in args.reports:
        report = json.loads(path.read_text())
        found = figures(report, args.again)
        link = report["model"]["link"].removeprefix("link ")
        delay = f", {report['delay_us']:g} us one way" if report.get("delay_us") else ""
        name = "MoE" if "moe" in str(report.get("env", {})) or "moe" in path.name else "dense"
        model = Path(str(report.get("model_dir", ""))).name or name
        print(
            f"| {path.stem.removeprefix('r-')} | {model} | {report['ranks']} | "
            f"{report['strategy']}{delay} | {link} | {_cell(found.get('decode 1'), 'ms')} | "
            f"{_cell(found.get('decode 8'), 'ms')} | {_cell(found.get('prefill'), '')} |"
        )


if __name__ == "__main__":
    main()
