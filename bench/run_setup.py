"""What every benchmark's command sets up the same way: its common options (the bench's
model cache, the load average it waits under), the environment its servers run with (the
model resolved into that cache, OpenBLAS preloaded as the ranks preload it), and its
report written as Markdown with the JSON beside it."""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from launcher.command import ROOT
from launcher.cpu_layer import preload

CACHE_DIR = Path.home() / ".cache" / "mlx-ring-bench"


def add_run_options(parser: argparse.ArgumentParser, report: str | None = None) -> None:
    """--cache-dir and --max-load, as every benchmark takes them; with `report`, also
    --load-patience and --markdown (default run/bench/REPORT.md)."""
    parser.add_argument("--cache-dir", type=Path, default=CACHE_DIR)
    parser.add_argument("--max-load", type=float, default=1.5, help="1-minute load average")
    if report is not None:
        parser.add_argument("--load-patience", type=float, default=600.0)
        parser.add_argument(
            "--markdown", type=Path, default=ROOT / "run" / "bench" / f"{report}.md"
        )


def bench_environment(cache_dir: Path, **settings: str) -> dict[str, str]:
    """This process's environment with `settings`, the model cache and OpenBLAS preloaded
    (the few-row kernel is each server's own choice); MODEL empty unless given."""
    env = os.environ.copy() | {"MODEL": "", "MODEL_CACHE_DIR": str(cache_dir)} | settings
    return env | preload(env, few_rows=False)


def write_report(path: Path, text: str, results: Any) -> None:
    """The Markdown report at `path` and its figures as JSON beside it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.with_suffix(".json").write_text(json.dumps(results, indent=2) + "\n")


def run_each(
    args: argparse.Namespace,
    model: Callable[[dict[str, str]], Path],
    run: Callable[[int, argparse.Namespace, dict[str, str], Path], Any],
    render: Callable[[dict[int, Any], str], str],
) -> int:
    """In the bench's environment, with the model `model` resolves in it: `run` at each of
    `args.ranks`, the results rendered (with the time they started) and printed, and
    written to `args.markdown`; the command's exit status."""
    env = bench_environment(args.cache_dir)
    path = model(env)
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    results: dict[int, Any] = {}
    for count in args.ranks:  # the report is written after each count: a later failure keeps it
        results[count] = run(count, args, env, path)
        text = render(results, started)
        write_report(args.markdown, text, results)
    print(text)
    return 0
