"""Tables for bench.compare: ours against the peer, ratios against the issue's targets."""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

from bench.stats import Summary
from launcher.cpu_layer import first_cpu

OURS = "ours"
PEER = "mlx_lm.server"

# The targets against the peer, each stated once (docs/BENCHMARKS.md's current tables):
# (label, workload, figure, target ratio, higher is better)
TARGETS = [
    ("decode tok/s per request, 1 client (median)", "single", "decode_median", 1.3, True),
    ("aggregate tok/s, {c} clients", "concurrent", "throughput", 1.2, True),
    ("time to first token, {c} clients (median s)", "concurrent", "ttft_median", 1.0, False),
    ("time to first token, {c} clients (p90 s)", "concurrent", "ttft_p90", 1.0, False),
    ("time to first token, long prompt (median s)", "long", "ttft_median", 1.0, False),
    ("time to first token, agent turns 2-4 (median s)", "agent_later", "ttft_median", 1.0, False),
]
INFO = [
    ("time to first token, 1 client (median s)", "single", "ttft_median", True),
    ("inter-token latency, {c} clients (median ms)", "concurrent", "itl_median", False),
    ("inter-token latency, {c} clients (p90 ms)", "concurrent", "itl_p90", False),
    ("decode tok/s per request, {c} clients (median)", "concurrent", "decode_median", True),
    ("completion tokens, 1 client (all requests)", "single", "tokens", None),
    ("completion tokens, {c} clients (all requests)", "concurrent", "tokens", None),
    ("prompt tokens, long prompt (median)", "long", "prompt_tokens", None),
    ("time to first token, agent turn 1 (median s)", "agent_first", "ttft_median", False),
    ("idle CPU, all processes (% of a core)", "idle", "cpu", False),
]


def figure(summary: Summary, name: str) -> float | None:
    """One named figure of a workload summary."""
    return {
        "decode_median": summary.decode_tok_s.median,
        "throughput": summary.throughput_tok_s,
        "ttft_median": summary.ttft_s.median,
        "ttft_p90": summary.ttft_s.p90,
        "itl_median": summary.itl_ms.median,
        "itl_p90": summary.itl_ms.p90,
        "tokens": float(summary.completion_tokens_total),
        "prompt_tokens": summary.prompt_tokens_median,
        "cpu": sum(summary.server_cpu.values()),
    }[name]


def ratio(ours: float | None, peer: float | None) -> float | None:
    return None if ours is None or not peer else ours / peer


def ratio_rows(by_server: dict[str, dict[str, Summary] | str], peer_name: str = PEER) -> list[dict]:
    """Target rows then informational rows: figure of each server, ours/peer, verdict."""
    rows = []
    ours, peer = (by_server.get(name) for name in (OURS, peer_name))
    ours = ours if isinstance(ours, dict) else None  # a string says why that server failed
    peer = peer if isinstance(peer, dict) else None
    c = next((x["concurrent"].concurrency for x in (ours, peer) if x), "C")

    def both(workload: str, name: str) -> tuple[float | None, float | None]:
        return tuple(
            figure(x[workload], name) if x and workload in x else None for x in (ours, peer)
        )

    for label, workload, name, target, higher in TARGETS:
        a, b = both(workload, name)
        r = ratio(a, b)
        met = None if r is None else (r >= target if higher else r <= target)
        sign = ">=" if higher else "<="
        rows.append(
            {
                "label": label.format(c=c),
                "ours": a,
                "peer": b,
                "ratio": r,
                "target": f"{sign} {target}x",
                "met": met,
            }
        )
    for label, workload, name, _ in INFO:
        a, b = both(workload, name)
        rows.append(
            {
                "label": label.format(c=c),
                "ours": a,
                "peer": b,
                "ratio": ratio(a, b),
                "target": "",
                "met": None,
            }
        )
    return rows


def _num(value: float | None, digits: int = 2) -> str:
    if value is None:
        return "-"
    return f"{value:.0f}" if abs(value) >= 1000 else f"{value:.{digits}f}"


def summaries_table(by_server: dict[str, dict[str, Summary] | str]) -> list[str]:
    lines = [
        "| server | workload | ok | tokens | agg tok/s | TTFT s (med / p90) | "
        "ITL ms (med / p90) | decode tok/s (med / p90) | server CPU, % of a core | load |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, workloads in by_server.items():
        if isinstance(workloads, str):
            lines.append(f"| {name} | failed: {workloads.replace('|', '/')} | | | | | | | | |")
            continue
        for s in workloads.values():
            lines.append(
                f"| {name} | {s.label} | {s.requests - s.errors}/{s.requests} | "
                f"{s.completion_tokens_total} | {_num(s.throughput_tok_s, 1)} | "
                f"{_num(s.ttft_s.median, 3)} / {_num(s.ttft_s.p90, 3)} | "
                f"{_num(s.itl_ms.median, 1)} / {_num(s.itl_ms.p90, 1)} | "
                f"{_num(s.decode_tok_s.median, 1)} / {_num(s.decode_tok_s.p90, 1)} | "
                f"{', '.join(f'{k} {v:.0f}' for k, v in sorted(s.server_cpu.items()))} | "
                f"{_num(s.load_average)} |"
            )
    return lines


def ratios_table(
    by_server: dict[str, dict[str, Summary] | str], peer_name: str = PEER
) -> list[str]:
    lines = [
        f"| figure | {OURS} | {peer_name} | ours/peer | target | met |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for row in ratio_rows(by_server, peer_name):
        met = {True: "yes", False: "**no**", None: ""}[row["met"]]
        lines.append(
            f"| {row['label']} | {_num(row['ours'])} | {_num(row['peer'])} | "
            f"{_num(row['ratio'])} | {row['target']} | {met} |"
        )
    return lines


def cpu_and_memory() -> tuple[str, int | None]:
    """The CPU's model and the memory in bytes: Linux's /proc, macOS's sysctl."""
    if sys.platform == "darwin":

        def sysctl(name: str) -> str:
            done = subprocess.run(["sysctl", "-n", name], capture_output=True, text=True)
            return done.stdout.strip()

        memory = sysctl("hw.memsize")
        return sysctl("machdep.cpu.brand_string") or "unknown CPU", int(memory or 0) or None
    cpu = first_cpu().get("model name", "unknown CPU")
    meminfo = Path("/proc/meminfo")
    if not meminfo.exists():
        return cpu, None
    return cpu, int(meminfo.read_text().split("MemTotal:")[1].split()[0]) * 1024


def machine(blas: str) -> list[str]:
    """CPU model, cores, memory, OS and package versions."""
    cpu, total = cpu_and_memory()
    memory = f", {total / 2**30:.0f} GiB memory" if total else ""
    versions = ", ".join(f"{p} {_version(p)}" for p in ("mlx", "mlx-lm", "fastapi", "uvicorn"))
    return [
        f"- CPU: {cpu}, {os.cpu_count()} cores{memory}, no GPU",
        f"- OS: {platform.platform()}; Python {platform.python_version()}; {versions}",
        f"- BLAS: {blas or 'none'} preloaded into both servers (LD_PRELOAD); "
        "OPENBLAS_NUM_THREADS per rank = cores / local ranks for both (launch.sh's rule; "
        "--openblas-threads overrides it)",
    ]


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def markdown_report(
    results: dict[str, dict[str, dict[str, Summary] | str]],
    args: argparse.Namespace,
    model_dir: Path,
    started: datetime.datetime,
    argv: list[str],
    blas: str,
    even_dir: Path | None = None,
) -> str:
    """The whole comparison as markdown: setup, one section per rank count."""
    lines = [
        f"# Ours against mlx_lm.server ({started:%Y-%m-%d %H:%M} UTC)",
        "",
        f"Command: `.venv/bin/python -m bench.compare {' '.join(shlex.quote(a) for a in argv)}`",
        "",
        *machine(blas),
        f"- Model directory (both servers): `{model_dir}`",
        *(
            [
                f"- Even-head variant (bench.even_model: heads pruned so that both servers can "
                f"split them at 2 ranks; stop tokens never win, so answers run to max_tokens): "
                f"`{even_dir}`"
            ]
            if even_dir
            else []
        ),
        f"- Workloads: 1 client x {args.single_requests} requests x {args.max_tokens} tokens; "
        f"{args.concurrency} clients x {args.rounds} request(s) x {args.max_tokens} tokens; "
        f"{args.long_trials} prompts of about {args.long_tokens} tokens x "
        f"{args.long_max_tokens} tokens; {args.agent_conversations} agent conversations of 4 "
        f"turns x {args.agent_max_tokens} tokens after a {args.agent_system_tokens}-token "
        "system prompt, each turn resending the whole conversation. Greedy; every prompt "
        "starts with a unique tag (prompt-cache hits only within an agent conversation); "
        "2 warm-up requests per server first. `load`: the 1-minute load average when the "
        "workload started.",
        "",
    ]
    for key, by_server in results.items():
        lines += [f"## {key}", ""]
        for peer_name in [name for name in by_server if name.startswith(PEER)]:
            lines += [*ratios_table(by_server, peer_name), ""]
        lines += [*agent_lines(by_server), *summaries_table(by_server), ""]
    return "\n".join(lines)


def agent_lines(by_server: dict[str, dict[str, Summary] | str]) -> list[str]:
    """Each server's later agent turns against its own first turn (target for ours: 0.1x)."""
    lines = []
    for name, workloads in by_server.items():
        if not isinstance(workloads, dict) or "agent_later" not in workloads:
            continue
        first = figure(workloads["agent_first"], "ttft_median")
        later = figure(workloads["agent_later"], "ttft_median")
        r = ratio(later, first)
        verdict = "" if name != OURS or r is None else (" (met)" if r <= 0.1 else " (missed)")
        shown = "-" if r is None else f"{r:.3f}x"
        lines.append(
            f"- {name}: agent turns 2-4 wait {shown} of turn 1's time to first token"
            + (f", target <= 0.1x{verdict}" if name == OURS else "")
        )
    return [*lines, ""] if lines else []


def rows_table(header: str, rows: list[dict[str, Any]], cells: Callable[[dict], str]) -> str:
    """A Markdown table of a benchmark's rows under `header` (its cells joined by " | "):
    each row's ranks and server, then `cells(row)`, or "failed: " and its error."""
    columns = header.count(" | ") + 1
    lines = [f"| {header} |", "| " + " | ".join(["---"] * columns) + " |"]
    for row in rows:
        rest = cells(row) if row["ok"] else f"failed: {row['error']}" + " |" * (columns - 3)
        lines.append(f"| {row['ranks']} | {row['server']} | {rest} |")
    return "\n".join(lines)
