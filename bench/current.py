"""The current figures at the top of docs/BENCHMARKS.md, written from recorded runs so the
table cannot drift from the figures.

`bench.compare --record` keeps each setup of its run (backend, rank count) as one JSON
record in docs/bench/ (date, machine, commit, command, every server's figures, the ratios
against each peer); the newest record per setup replaces the older. `render` rebuilds the
section between the markers of docs/BENCHMARKS.md from all records: one table per backend
and rank count, each target once, met or not against every peer measured in that run (the
peer as shipped, and `peer-rows`, given our matrix kernels: the engine's own ratio).

    .venv/bin/python -m bench.current render      # after editing or adding records
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
from pathlib import Path
from typing import Any

from launcher.command import ROOT

RECORDS = ROOT / "docs" / "bench"
DOC = ROOT / "docs" / "BENCHMARKS.md"
BEGIN = "<!-- current figures: written by `python -m bench.current render`; do not edit -->"
END = "<!-- end of current figures -->"


def backend() -> str:
    """Which MLX backend the ranks ran: the record's first key."""
    import mlx.core as mx

    if mx.metal.is_available():
        return "metal"
    cuda = getattr(mx, "cuda", None)
    return "cuda" if cuda is not None and cuda.is_available() else "cpu"


def commit() -> str:
    done = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    )
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    return done.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def record(
    run: dict[str, Any], command: str, machine: str, directory: Path = RECORDS
) -> list[Path]:
    """One record per setup of a bench.compare run (its JSON, as compare writes it) that
    some peer measured: a setup every peer sat out (the peer cannot split the model) has
    no ratio to keep, and keeps the record it had."""
    directory.mkdir(parents=True, exist_ok=True)
    kind = backend()
    written = []
    for setup, ratios in run["ratios"].items():
        if not any(ratios.values()):
            continue
        entry = {
            "backend": kind,
            "setup": setup,
            "date": run["date"],
            "machine": machine,
            "commit": commit(),
            "command": command,
            "ratios": ratios,
        }
        path = directory / f"compare-{kind}-{slug(setup)}.json"
        path.write_text(json.dumps(entry, indent=1) + "\n")
        written.append(path)
    return written


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _table(entry: dict[str, Any]) -> list[str]:
    peers = [name for name, rows in entry["ratios"].items() if rows]
    head = "| target | " + " | ".join(f"ours / {p}" for p in peers) + " |"
    lines = [head, "|" + " --- |" * (len(peers) + 1)]
    first = entry["ratios"][peers[0]]
    for index, row in enumerate(first):
        if not row["target"]:
            continue
        cells = []
        for peer in peers:
            other = entry["ratios"][peer][index]
            verdict = {True: "met", False: "**missed**", None: "no figure"}[other["met"]]
            cells.append(
                f"{_num(other['ratio'])}x ({_num(other['ours'])} / "
                f"{_num(other['peer'])}): {verdict}"
            )
        lines.append(f"| {row['label']}, {row['target']} | " + " | ".join(cells) + " |")
    return lines


def render(directory: Path = RECORDS) -> str:
    entries = [json.loads(p.read_text()) for p in sorted(directory.glob("compare-*.json"))]
    entries.sort(key=lambda e: (e["backend"], e["setup"]))
    out = [BEGIN, ""]
    for entry in entries:
        out += [
            f"### {entry['backend'].upper()} backend, {entry['setup']}",
            "",
            f"Measured {entry['date']} on {entry['machine']}, commit {entry['commit']}:",
            f"`{entry['command']}`",
            "",
            *_table(entry),
            "",
        ]
    if not entries:
        out += ["(no recorded runs: `bench.compare --record` writes them)", ""]
    return "\n".join([*out, END])


def update(doc: Path = DOC, directory: Path = RECORDS) -> None:
    text = doc.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{doc} has no current-figures markers; add {BEGIN!r} and {END!r}")
    before, rest = text.split(BEGIN, 1)
    after = rest.split(END, 1)[1]
    doc.write_text(before + render(directory) + after)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("action", choices=["render"])
    parser.parse_args(argv)
    update()
    print(f"wrote the current figures into {DOC}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
