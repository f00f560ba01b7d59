"""docs/BENCHMARKS.md's table of the step-time model against this machine: predicted and
measured decode (1 and 8 clients) and prefill, from bench/step_time.py's reports.

    .venv/bin/python -m bench.step_model run/bench/r-*.json [--again] [--group]

Each report carries the cluster's own figures: the medians of its measured steps, the
model's predictions for the same steps (made in the server, from the rates and link the
ranks measured at start), and what they were made from (the plan, every rank's machine
record, the link, the steps' contexts, the prefill's forwards). `--again` predicts once
more from those records with this checkout's distributed/step_model.py, so a change of
the model is checked against the measurements already taken. `--group`: one row for the
runs of one setup (model, ranks, plan, delay, settings), its medians and each run's error,
since on a shared 2-core VM one setup's steps varied by a quarter from one run to the next.
"""

from __future__ import annotations

import argparse
import json
import statistics
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
    shares = tuple(tuple(layer) for layer in speed.get("expert_shares") or ())
    return ClusterModel(work, speed_from_record(speed)).routed_as(shares)


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


def _cell(pairs: list[tuple[float, float]], unit: str) -> str:
    if not pairs:
        return "-"
    predicted = statistics.median(p for p, _ in pairs)
    measured = statistics.median(m for _, m in pairs)
    text = f"{predicted:.1f} / {measured:.1f} {unit} ({(predicted - measured) / measured:+.0%})"
    if len(pairs) > 1:
        text += " [" + ", ".join(f"{(p - m) / m:+.0%}" for p, m in pairs) + "]"
    return text


def _setup(report: dict[str, Any]) -> str:
    """What a run measured, whatever its name: runs of one setup share it (the cores a
    rank could use among it: a run under `taskset -c 0` is a setup of its own)."""
    env = ",".join(f"{k}={v}" for k, v in sorted(report.get("env", {}).items()))
    cores = report["model"]["speed"]["machines"][0]["cores"]
    return f"{report.get('model_dir')}|{report['ranks']}|{report['strategy']}|" + (
        f"{report.get('delay_us')}|{env}|{cores}"
    )


def _links(reports: list[dict[str, Any]]) -> str:
    """The link each run measured at start; for several, the range of each figure."""
    if len(reports) == 1:
        return str(reports[0]["model"]["link"]).removeprefix("link ")
    name = reports[0]["model"]["speed"]["link"][0]
    latency = [float(r["model"]["speed"]["link"][1]) for r in reports]
    rate = [float(r["model"]["speed"]["link"][2]) for r in reports]
    return (
        f"{name}: {min(latency):.0f}-{max(latency):.0f} us + {min(rate):.2f}-{max(rate):.2f} "
        "GB/s a collective"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("reports", type=Path, nargs="+")
    parser.add_argument("--again", action="store_true", help="predict again from the records")
    parser.add_argument("--group", action="store_true", help="one row for a setup's runs")
    args = parser.parse_args()
    print(
        "| run | model | ranks | plan | link (measured at start) | decode step, 1 client: "
        "predicted / measured | 8 clients | prefill tok/s |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    rows: dict[str, list[tuple[Path, dict[str, Any]]]] = {}
    for path in args.reports:
        report = json.loads(path.read_text())
        key = _setup(report) if args.group else str(path)
        rows.setdefault(key, []).append((path, report))
    for runs in rows.values():
        path, report = runs[0]
        found = [figures(r, args.again) for _, r in runs]
        links = _links([r for _, r in runs])
        delay = f", {report['delay_us']:g} us one way" if report.get("delay_us") else ""
        name = "MoE" if "moe" in str(report.get("env", {})) or "moe" in path.name else "dense"
        model = Path(str(report.get("model_dir", ""))).name or name
        cells = [
            _cell([f[key] for f in found if key in f], unit)
            for key, unit in (("decode 1", "ms"), ("decode 8", "ms"), ("prefill", ""))
        ]
        print(
            f"| {path.stem.removeprefix('r-')}{f' ({len(runs)} runs)' if len(runs) > 1 else ''} "
            f"| {model} | {report['ranks']} | "
            f"{report['strategy']}{delay} | {links} | " + " | ".join(cells) + " |"
        )


if __name__ == "__main__":
    main()
