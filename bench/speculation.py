"""Speculative decoding against mlx_lm.server: an agent's edit, free text, 8 clients.

    .venv/bin/python -m bench.speculation [--ranks 1 2] [--markdown run/bench/speculation.md]
    .venv/bin/python -m bench.speculation --ranks 1 --spec-tokens 4 8 --servers   # SPEC_TOKENS
    .venv/bin/python -m bench.speculation --alternate 3 --aggregate-trials 2  # on/off, 8 clients

For each rank count, three servers on the same model directory, one after another: ours
with SPECULATIVE=off, ours with SPECULATIVE=auto (prompt lookup, leader/speculation.py) and
mlx_lm.server given our few-row sgemm (bench.compare's `peer-rows`), so the ratio is the
engine's. At 2 ranks all three serve the even-head variant (bench/even_model.py): the
peer cannot split the default model's heads. Workloads, greedy:
- edit: the model is asked to return a 300-400-token source file (EDIT_SOURCE) with one
  small change, one request at a time; decode tokens/s per request;
- free text: an essay, one request at a time;
- aggregate: 8 clients at once, completion tokens per second of wall time; the median of
  --aggregate-trials runs (3), each run's figure kept in the JSON.
Ours' proposed and accepted tokens come from /metrics (speculation_*), read around each
workload.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import tempfile
import time
from pathlib import Path

import httpx

from bench.compare import resolve_model_dir, token_counter
from bench.even_model import make_even_variant
from bench.loadgen import Endpoint, run_load
from bench.prompts import essay_prompt
from bench.run_setup import add_run_options, bench_environment, write_report
from bench.servers import Ours, Peer, load_average, log, wait_quiet
from bench.stats import Summary, summarize

EDIT_SOURCE = '''\
import json
import time
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Job:
    """One unit of work in the queue."""

    name: str
    command: list[str]
    retries: int = 3
    timeout: float = 30.0
    tags: list[str] = field(default_factory=list)


class JobQueue:
    """Jobs kept in a JSON file, oldest first."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.jobs: list[Job] = []
        if path.exists():
            for entry in json.loads(path.read_text()):
                self.jobs.append(Job(**entry))

    def add(self, job: Job) -> None:
        self.jobs.append(job)
        self.save()

    def next(self) -> Job | None:
        if not self.jobs:
            return None
        job = self.jobs.pop(0)
        self.save()
        return job

    def save(self) -> None:
        entries = [job.__dict__ for job in self.jobs]
        self.path.write_text(json.dumps(entries, indent=2))

    def wait_for(self, name: str, poll: float = 0.5) -> bool:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if all(job.name != name for job in self.jobs):
                return True
            time.sleep(poll)
        return False
'''
EDITS = [
    "change the default timeout from 30.0 to 45.0",
    "rename the method `next` to `take`",
    "change the default retries from 3 to 5",
]


def edit_prompt(index: int) -> str:
    return (
        f"Here is a Python file:\n\n```python\n{EDIT_SOURCE}```\n\n"
        f"Return the whole file with one change: {EDITS[index % len(EDITS)]}. "
        "Reply with the complete file in one code block and nothing else."
    )


def speculation_counts(url: str) -> tuple[float, float]:
    """(proposed, accepted) tokens since the start, from /metrics; zeros for the peer."""
    try:
        text = httpx.get(f"{url}/metrics", timeout=10).text
    except httpx.HTTPError:
        return 0.0, 0.0

    def value(name: str) -> float:
        found = re.search(
            rf"^speculation_{name}(?:_total)?(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M
        )
        return float(found.group(1)) if found else 0.0

    return value("proposed_tokens"), value("accepted_tokens")


def run_workloads(endpoint: Endpoint, args: argparse.Namespace, tag: str) -> dict:
    """The three workloads against one server: summaries, and ours' acceptance."""

    def load(label: str, prompts: list[str], concurrency: int, max_tokens: int) -> dict:
        proposed, accepted = speculation_counts(endpoint.url)
        load_before = load_average()
        results = asyncio.run(run_load(endpoint, prompts, concurrency, max_tokens))
        summary: Summary = summarize(label, concurrency, results)
        summary.load_average = round(load_before, 2)
        after_proposed, after_accepted = speculation_counts(endpoint.url)
        return {
            "summary": summary.model_dump(),
            "proposed": after_proposed - proposed,
            "accepted": after_accepted - accepted,
        }

    load("warm-up", [essay_prompt(0, f"{tag}-warm")], 1, 16)
    edits = [f"[{tag}-e{i}] " + edit_prompt(i) for i in range(args.edit_requests)]
    essays = [essay_prompt(i, f"{tag}-f{i}") for i in range(args.free_requests)]
    results = {
        "edit": load("edit", edits, 1, args.edit_max_tokens),
        "free": load("free text", essays, 1, args.max_tokens),
    }
    # The aggregate's spread between runs (this 2-core VM) is as large as what is compared:
    # the trial of median throughput stands for the server, and all are kept.
    trials = []
    for trial in range(args.aggregate_trials):
        batch = [essay_prompt(i, f"{tag}-c{trial}-{i}") for i in range(args.concurrency)]
        trials.append(load(f"{args.concurrency} clients", batch, args.concurrency, args.max_tokens))
    trials.sort(key=lambda t: t["summary"]["throughput_tok_s"])
    results["aggregate"] = trials[len(trials) // 2] | {
        "trials": [t["summary"]["throughput_tok_s"] for t in trials],
        "proposed": sum(t["proposed"] for t in trials),
        "accepted": sum(t["accepted"] for t in trials),
    }
    return results


def _fig(entry: dict | str, workload: str, name: str) -> float | None:
    if isinstance(entry, str):
        return None
    summary = entry[workload]["summary"]
    if name == "decode":
        return summary["decode_tok_s"]["median"]
    if name == "throughput":
        return summary["throughput_tok_s"]
    if name == "acceptance":
        proposed = entry[workload]["proposed"]
        return entry[workload]["accepted"] / proposed if proposed else None
    raise KeyError(name)


def _num(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or not b else f"{a / b:.2f}x"


def markdown(results: dict, args: argparse.Namespace, started: str) -> str:
    lines = [
        f"# Speculative decoding ({started}, `python -m bench.speculation "
        f"--ranks {' '.join(map(str, args.ranks))}`)",
        "",
    ]
    rows = [
        ("edit: decode tok/s per request (median)", "edit", "decode"),
        ("free text: decode tok/s per request (median)", "free", "decode"),
        (
            f"{args.concurrency} clients: aggregate tok/s (median of {args.aggregate_trials})",
            "aggregate",
            "throughput",
        ),
    ]
    for key, by in results.items():
        on, off, peer = by.get("spec on"), by.get("spec off"), by.get("peer-rows")
        lines += [
            f"## {key}",
            "",
            "| figure | spec on | spec off | peer-rows | on / peer | on / off |",
            "|---|---|---|---|---|---|",
        ]
        for label, workload, name in rows:
            a, b, c = (_fig(x, workload, name) if x else None for x in (on, off, peer))
            lines.append(
                f"| {label} | {_num(a, 1)} | {_num(b, 1)} | {_num(c, 1)} "
                f"| {_ratio(a, c)} | {_ratio(a, b)} |"
            )
        for workload in ("edit", "free", "aggregate"):
            rate = _fig(on, workload, "acceptance") if on else None
            if on and not isinstance(on, str):
                lines.append(
                    f"| {workload}: proposed / accepted tokens (spec on) "
                    f"| {on[workload]['proposed']:.0f} / {on[workload]['accepted']:.0f} "
                    f"({_num(rate and rate * 100, 0)}%) | | | | |"
                )
        failed = [f"{name}: {entry}" for name, entry in by.items() if isinstance(entry, str)]
        lines += [""] + [f"- {line}" for line in failed]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--model", default="", help="MODEL setting ('' = default SmolLM2)")
    parser.add_argument("--edit-requests", type=int, default=3)
    parser.add_argument("--edit-max-tokens", type=int, default=500)
    parser.add_argument("--free-requests", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--aggregate-trials", type=int, default=3, help="median of these")
    parser.add_argument(
        "--alternate", type=int, default=0, help="rounds of the aggregate alone, on then off"
    )
    parser.add_argument(
        "--spec-tokens", type=int, nargs="+", default=[8], help="SPEC_TOKENS of each 'spec on'"
    )
    parser.add_argument(
        "--servers", nargs="*", default=["off", "peer-rows"], help="also: off, peer-rows"
    )
    add_run_options(parser, "speculation")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    env = bench_environment(args.cache_dir, MODEL=args.model)
    model_dir = resolve_model_dir(env)
    token_counter(model_dir)  # the tokenizer loads: the model directory is whole
    if args.alternate:
        return alternate(args, env, model_dir)
    workdir = Path(tempfile.mkdtemp(prefix="bench-speculation-"))
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    stamp = f"{time.time_ns():x}"
    results: dict[str, dict] = {}
    for ranks in args.ranks:
        directory = model_dir
        key = f"{ranks} rank{'s' if ranks > 1 else ''}"
        if ranks > 1:
            directory = make_even_variant(model_dir, args.cache_dir / f"even-{model_dir.name}")
            key += ", even-head variant"
        servers = {
            f"spec on{'' if n == args.spec_tokens[0] else f', {n} tokens'}": Ours(
                ranks, env | {"SPECULATIVE": "auto", "SPEC_TOKENS": str(n)}, directory, workdir
            )
            for n in args.spec_tokens
        }
        if "off" in args.servers:
            servers["spec off"] = Ours(ranks, env | {"SPECULATIVE": "off"}, directory, workdir)
        if "peer-rows" in args.servers:
            servers["peer-rows"] = Peer(ranks, env, directory, workdir, True, few_rows=True)
        results[key] = {}
        for name, server in servers.items():
            wait_quiet(args.max_load, args.load_patience)
            log(f"{name}, {key}: starting")
            try:
                server.start()
                results[key][name] = run_workloads(server.endpoint, args, f"{stamp}-{ranks}")
            except RuntimeError as exc:
                results[key][name] = str(exc).splitlines()[0]
            finally:
                server.stop()
            log(f"{name}, {key}: {json.dumps(_brief(results[key][name]))}")
    text = markdown(results, args, started)
    print(text)
    write_report(args.markdown, text, results)
    log(f"wrote {args.markdown}")
    return 0


def alternate(args: argparse.Namespace, env: dict[str, str], model_dir: Path) -> int:
    """--alternate N: the aggregate (--concurrency clients) alone at one rank, ours with
    speculation on then off, N times over, `--aggregate-trials` runs each: servers minutes
    apart drift."""
    workdir = Path(tempfile.mkdtemp(prefix="bench-speculation-"))
    figures: dict[str, list[float]] = {"auto": [], "off": []}
    for round_ in range(args.alternate):
        for mode in figures:
            wait_quiet(args.max_load, args.load_patience)
            server = Ours(1, env | {"SPECULATIVE": mode}, model_dir, workdir)
            try:
                server.start()
                for trial in range(args.aggregate_trials):
                    n = args.concurrency
                    batch = [essay_prompt(i, f"a{round_}-{trial}-{i}") for i in range(n)]
                    results = asyncio.run(run_load(server.endpoint, batch, n, args.max_tokens))
                    figures[mode].append(summarize(str(n), n, results).throughput_tok_s)
                    log(f"SPECULATIVE={mode}: {figures[mode][-1]:.1f} tok/s")
            finally:
                server.stop()
    on, off = (sum(v) / len(v) for v in figures.values())
    log(f"mean on {on:.1f}, off {off:.1f} tok/s: {on / off:.2f}x")
    return 0


def _brief(entry: dict | str) -> dict | str:
    if isinstance(entry, str):
        return entry
    return {w: _fig(entry, w, "throughput" if w == "aggregate" else "decode") for w in entry}


if __name__ == "__main__":
    raise SystemExit(main())
