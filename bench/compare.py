"""Our cluster against mlx_lm.server: same model directory, rank count and machine, one run.

    .venv/bin/python -m bench.compare [--ranks 1 2] [--markdown run/bench/compare.md]
    .venv/bin/python -m bench.compare --moe --ranks 1 2 3 --even-ranks   # the MoE model

`--moe` runs a random-weight qwen3_moe model of about 330 MB (bench/moe_model.py, written
once into --cache-dir with the default model's tokenizer). mlx_lm.server runs only at the
rank counts its even shard() can split (the others are reported as not run, with why).

For each rank count: start our cluster with `./launch.sh start` (NUM_DEVICES, an own
API_PORT, SOCKET_PATH and MODEL_CACHE_DIR), run the workloads, `./launch.sh stop`; then
mlx_lm.server on the same MLX directory (directly at 1 rank, under mlx.launch with the
ring backend on 127.0.0.1 above), the same workloads, stop it. Both get Debian's OpenBLAS
preloaded; ours also its few-row sgemm (native/sgemm_rows.c), which `--servers peer-rows`
gives the peer too. Workloads: CPU with no requests (--idle seconds); 1 client x 128 tokens; 8
concurrent clients x 128 tokens; a prompt of about 1500 tokens (time to first token).
Greedy decoding; neither server can be told to ignore EOS, so prompts ask for long
answers and tokens are counted from `usage`.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import current
from bench.even_model import make_even_variant
from bench.loadgen import Endpoint, run_conversation, run_load
from bench.moe_model import make_moe_model, peer_cannot_split
from bench.prompts import AGENT_QUESTIONS, agent_system_prompt, essay_prompt, long_prompt
from bench.report import cpu_and_memory, markdown_report, ratio_rows
from bench.run_setup import add_run_options
from bench.servers import (
    PY,
    ROOT,
    BenchRefused,
    Ours,
    Peer,
    group_cpu,
    load_average,
    log,
    wait_quiet,
)
from bench.stats import RequestResult, Summary, summarize, table
from launcher.cpu_layer import OPENBLAS, preload

# ---- workloads --------------------------------------------------------------------------


def run_workloads(server, args: argparse.Namespace, counter, tag: str) -> dict:
    """The three workloads against one server; summaries by workload key. A workload that
    outlives --workload-timeout counts as failed requests; the server's CPU use (share of
    one core per process role) is recorded with each workload."""
    endpoint = server.endpoint

    def cpu_since(before: dict[str, float], seconds: float) -> dict[str, float]:
        after = group_cpu(server.process_groups())
        return {
            role: round((after[role] - before.get(role, 0.0)) / seconds * 100, 1) for role in after
        }

    def load(label: str, prompts: list[str], concurrency: int, max_tokens: int) -> Summary:
        before = group_cpu(server.process_groups())
        load = load_average()
        start = time.monotonic()
        try:
            results = asyncio.run(
                asyncio.wait_for(
                    run_load(endpoint, prompts, concurrency, max_tokens), args.workload_timeout
                )
            )
        except TimeoutError:
            failed = f"timed out after {args.workload_timeout:.0f} s"
            results = [RequestResult(error=failed, start=start) for _ in prompts]
        summary = summarize(label, concurrency, results)
        summary.load_average = round(load, 2)
        summary.server_cpu = cpu_since(before, time.monotonic() - start)
        return summary

    load("warm-up", [essay_prompt(i, f"{tag}-warm{i}") for i in range(2)], 1, 16)
    out: dict[str, Summary] = {}
    if args.idle:
        before, load_before, start = (
            group_cpu(server.process_groups()),
            load_average(),
            time.monotonic(),
        )
        time.sleep(args.idle)
        out["idle"] = summarize(f"idle {args.idle:.0f} s", 0, [])
        out["idle"].load_average = round(load_before, 2)
        out["idle"].server_cpu = cpu_since(before, time.monotonic() - start)
    single = [essay_prompt(i, f"{tag}-s{i}") for i in range(args.single_requests)]
    out["single"] = load("1 client", single, 1, args.max_tokens)
    batch = [essay_prompt(i, f"{tag}-c{i}") for i in range(args.concurrency * args.rounds)]
    out["concurrent"] = load(
        f"{args.concurrency} clients", batch, args.concurrency, args.max_tokens
    )
    long = [long_prompt(args.long_tokens, f"{tag}-l{i}", counter) for i in range(args.long_trials)]
    out["long"] = load(f"{args.long_tokens}-token prompt", long, 1, args.long_max_tokens)
    if args.agent_conversations:
        out |= agent_workload(endpoint, args, counter, tag)
    return out


def agent_workload(endpoint: Endpoint, args: argparse.Namespace, counter, tag: str) -> dict:
    """Agents resending their conversation: a long system prompt, 4 turns each; the first
    turns and the later turns summarized apart."""
    first: list[RequestResult] = []
    later: list[RequestResult] = []
    for i in range(args.agent_conversations):
        system = agent_system_prompt(args.agent_system_tokens, f"{tag}-a{i}", counter)
        turns = asyncio.run(
            run_conversation(endpoint, system, AGENT_QUESTIONS, args.agent_max_tokens)
        )
        first.append(turns[0])
        later += turns[1:]
    label = f"agent, {args.agent_system_tokens}-token system"
    return {
        "agent_first": summarize(f"{label}, turn 1", 1, first),
        "agent_later": summarize(f"{label}, turns 2-4", 1, later),
    }


def token_counter(model_dir: Path):
    """Counts tokens of text with the model's own tokenizer."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    return lambda text: len(tokenizer.encode(text))


def resolve_model_dir(env: dict[str, str]) -> Path:
    done = subprocess.run(
        [str(PY), "-m", "acquisition.source"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        raise BenchRefused(f"cannot resolve the model: {done.stderr.strip()[-400:]}")
    return Path(lines[-1])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ranks", type=int, nargs="*", default=[1, 2])
    parser.add_argument(
        "--servers",
        nargs="+",
        choices=["ours", "peer", "peer-quiet", "peer-rows"],
        default=["ours", "peer", "peer-quiet"],
        help="peer-quiet: mlx_lm.server with mlx.launch's relay busy loop stopped (>1 rank);"
        " peer-rows: with that, and our few-row sgemm preloaded (native/sgemm_rows.c)",
    )
    parser.add_argument("--model", default="", help="MODEL setting ('' = default SmolLM2)")
    parser.add_argument(
        "--moe",
        action="store_true",
        help="benchmark the random-weight qwen3_moe model (bench/moe_model.py) instead",
    )
    parser.add_argument("--import-dtype", default="float32")
    parser.add_argument(
        "--even-ranks",
        type=int,
        nargs="*",
        default=[2],
        help="also compare a pruned variant whose heads split evenly (bench.even_model)",
    )
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--single-requests", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=1, help="requests per client at C")
    parser.add_argument("--long-tokens", type=int, default=1500)
    parser.add_argument("--long-trials", type=int, default=3)
    parser.add_argument("--long-max-tokens", type=int, default=16)
    parser.add_argument(
        "--agent-conversations", type=int, default=2, help="multi-turn agent runs (0: none)"
    )
    parser.add_argument("--agent-system-tokens", type=int, default=1500)
    parser.add_argument("--agent-max-tokens", type=int, default=32)
    parser.add_argument("--idle", type=float, default=10.0, help="idle CPU window, seconds")
    parser.add_argument("--workload-timeout", type=float, default=420.0, help="seconds")
    parser.add_argument("--openblas-threads", default="", help="OPENBLAS_NUM_THREADS for both")
    add_run_options(parser, "compare")
    parser.add_argument("--json", type=Path, default=ROOT / "run" / "bench" / "compare.json")
    parser.add_argument(
        "--record",
        action="store_true",
        help="keep this run's figures in docs/bench/ and rewrite docs/BENCHMARKS.md's current "
        "tables (bench.current)",
    )
    return parser.parse_args(argv)


def setups(args: argparse.Namespace, model_dir: Path) -> list[tuple[str, int, Path]]:
    """(section title, ranks, model directory) for every comparison of this run."""
    out = [(f"{r} rank{'s' if r > 1 else ''}", r, model_dir) for r in args.ranks]
    if args.even_ranks:
        even = make_even_variant(model_dir, args.cache_dir / f"even-{model_dir.name}")
        for r in args.even_ranks:
            out.append((f"{r} ranks, even-head variant", r, even))
    return out


def run_one(server, key: str, args: argparse.Namespace, counter, tag: str):
    """Start, measure, stop one server; its summaries, or one line on why it failed."""
    wait_quiet(args.max_load, args.load_patience)
    log(f"{server.name}, {key}: starting (load average {load_average():.2f})")
    try:
        server.start()
        log(f"{server.name}, {key}: ready; running the workloads")
        summaries = run_workloads(server, args, counter, tag)
    except RuntimeError as exc:
        log(f"{server.name}, {key}: FAILED: {exc}")
        return str(exc).splitlines()[0]
    finally:
        server.stop()
        log(f"{server.name}, {key}: stopped")
    print(table(list(summaries.values())), flush=True)
    return summaries


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    env = os.environ.copy() | {
        "MODEL": args.model,
        "IMPORT_DTYPE": args.import_dtype,
        "MODEL_CACHE_DIR": str(args.cache_dir),
    }
    env |= preload(env, few_rows=False)  # ours adds it in each rank; the peers, below
    if args.openblas_threads:
        env["OPENBLAS_NUM_THREADS"] = args.openblas_threads
    model_dir = resolve_model_dir(env)
    if args.moe:
        model_dir = make_moe_model(model_dir, args.cache_dir / "moe-qwen3_moe-330M")
    log(f"model directory: {model_dir}")
    counter = token_counter(model_dir)
    workdir = Path(tempfile.mkdtemp(prefix="bench-compare-"))
    results: dict[str, dict] = {}
    stamp = f"{time.time_ns():x}"
    started = datetime.datetime.now(datetime.UTC)
    for index, (key, ranks, directory) in enumerate(setups(args, model_dir)):
        results[key] = {}
        for kind in args.servers:
            # the quiet launcher matters only under mlx.launch, and the real model's heads
            # crash the peer at 2 ranks with or without it: run it for the even variant
            if kind in ("peer-quiet", "peer-rows") and ranks > 1 and directory == model_dir:
                continue
            if kind == "peer-quiet" and ranks == 1:
                continue
            if kind == "ours":
                server = Ours(ranks, env, directory, workdir)
            else:
                quiet = kind in ("peer-quiet", "peer-rows")
                server = Peer(ranks, env, directory, workdir, quiet, few_rows=kind == "peer-rows")
                config = json.loads((directory / "config.json").read_text())
                reason = peer_cannot_split(config, ranks) if ranks > 1 else None
                if reason:
                    log(f"{server.name}, {key}: not run: {reason}")
                    results[key][server.name] = f"not run: {reason}"
                    continue
            tag = f"{stamp}-{index}"
            results[key][server.name] = run_one(server, key, args, counter, tag)
    even = next((d for _, _, d in setups(args, model_dir) if d != model_dir), None)
    report = markdown_report(results, args, model_dir, started, sys.argv[1:], str(OPENBLAS), even)
    print(report)
    for path, text in (
        (args.markdown, report),
        (args.json, json.dumps(_jsonable(results, args, model_dir, started), indent=2)),
    ):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
        log(f"wrote {path}")
    if args.record:
        run = _jsonable(results, args, model_dir, started)
        cpu, _ = cpu_and_memory()
        command = "python -m bench.compare " + " ".join(sys.argv[1:])
        for path in current.record(run, command, f"{cpu}, {os.cpu_count()} cores"):
            log(f"recorded {path}")
        current.update()
        log(f"rewrote the current figures in {current.DOC}")
    return 0


def _jsonable(results, args, model_dir: Path, started) -> dict:
    return {
        "date": started.isoformat(timespec="seconds"),
        "model_dir": str(model_dir),
        "machine": platform.platform(),
        "args": {k: str(v) for k, v in vars(args).items()},
        "results": {
            key: {
                name: sums
                if isinstance(sums, str)
                else {w: s.model_dump() for w, s in sums.items()}
                for name, sums in by.items()
            }
            for key, by in results.items()
        },
        "ratios": {
            key: {peer: ratio_rows(by, peer) for peer in by if peer != "ours"}
            for key, by in results.items()
        },
    }


def run(argv: list[str] | None = None) -> int:
    """main(), with a refused benchmark as one `error:` line and exit status 2."""
    try:
        return main(argv)
    except BenchRefused as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(run())
