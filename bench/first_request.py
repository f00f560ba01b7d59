"""The first request against the tenth identical one: after `./launch.sh start` with MLX's
kernel cache emptied (as after a reboot), and after a supervisor restart (a rank killed).

    .venv/bin/python -m bench.first_request [--ranks 2] [--requests 10] [--warm-cache]

Starts our cluster with launch.sh in this checkout (NUM_DEVICES, its own port and socket)
with TMPDIR pointing at a fresh directory: MLX's CPU backend keeps the kernels it compiles
under $TMPDIR/mlx/<version>/cpu (std::filesystem::temp_directory_path), so the ranks start
as on a machine whose /tmp was emptied, without touching the shared /tmp/mlx
(--warm-cache keeps the usual TMPDIR). Then sends --requests identical chats (what
`./launch.sh test` sends: "What is the capital of France?", greedy, 32 tokens) one after
another and reports each one's time as the client saw it (round trip) and as rank 0
measured it (`performance.total_time`), the first against the last, and one more after
--idle seconds without work (a control: as long a pause as the first had, no first
use); the same again after SIGKILL of the last rank (rank 0 alone at 1 rank), once the
supervisor has the job serving again. The warm-up's own time is read from server.log
("warm-up: ... steps, X s").
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from bench.compare import resolve_model_dir
from bench.run_setup import add_run_options, bench_environment
from bench.servers import ROOT, Ours, log, wait_quiet

PROMPT = "What is the capital of France?"
WARMED = re.compile(r"warm-up: .* steps, (?P<seconds>[\d.]+) s")


def ask(url: str, max_tokens: int) -> tuple[float, float]:
    """One greedy chat: (round trip, rank 0's total time) in seconds."""
    body = {
        "model": "default",
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    started = time.perf_counter()
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600)
    elapsed = time.perf_counter() - started
    response.raise_for_status()
    return elapsed, float(response.json().get("performance", {}).get("total_time", 0.0))


def series(url: str, count: int, max_tokens: int, idle_s: float) -> list[tuple[float, float]]:
    """`count` requests back to back, then one more after `idle_s` idle (the control: a
    request after as long a pause as the first one had, without its first use)."""
    times = [ask(url, max_tokens) for _ in range(count)]
    time.sleep(idle_s)
    return [*times, ask(url, max_tokens)]


def wait_ready(url: str, timeout: float) -> float:
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return time.monotonic() - started
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"/health not ready within {timeout:.0f} s")


def warmups(log_text: str) -> list[float]:
    return [float(found["seconds"]) for found in WARMED.finditer(log_text)]


def row(name: str, all_times: list[tuple[float, float]]) -> dict:
    times, control = all_times[:-1], all_times[-1]
    first, last = times[0], times[-1]
    return {
        "case": name,
        "first_round_trip_s": round(first[0], 3),
        "last_round_trip_s": round(last[0], 3),
        "ratio_round_trip": round(first[0] / last[0], 2),
        "first_rank0_s": round(first[1], 3),
        "last_rank0_s": round(last[1], 3),
        "ratio_rank0": round(first[1] / last[1], 2) if last[1] else None,
        "later_median_rank0_s": round(statistics.median(t[1] for t in times[1:]), 3),
        "all_round_trips_s": [round(t[0], 3) for t in times],
        "all_rank0_s": [round(t[1], 3) for t in times],
        "after_idle_rank0_s": round(control[1], 3),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--model", default="", help="MODEL setting ('' = default SmolLM2)")
    parser.add_argument("--requests", type=int, default=10)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--warm-cache", action="store_true", help="keep MLX's kernel cache")
    parser.add_argument("--idle", type=float, default=5.0, help="the control's pause (s)")
    add_run_options(parser)
    parser.add_argument("--json", type=Path, default=None, help="write the rows here too")
    args = parser.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="bench-first-"))
    env = bench_environment(args.cache_dir, MODEL=args.model)
    if not args.warm_cache:
        (workdir / "tmp").mkdir()
        env["TMPDIR"] = str(workdir / "tmp")  # an empty kernel cache for the ranks
    model_dir = resolve_model_dir(env)
    server = Ours(args.ranks, env, model_dir, workdir)
    wait_quiet(args.max_load, 600)
    server_log = ROOT / "server.log"
    offset = server_log.stat().st_size if server_log.exists() else 0
    started = time.monotonic()
    done = server.launch("start", 900)
    start_s = time.monotonic() - started
    if done.returncode != 0:  # no probe request: the first one timed is the first served
        server.stop()
        raise RuntimeError("./launch.sh start failed:\n" + done.stdout[-1500:] + done.stderr)
    url = server.endpoint.url
    rows = []
    # This process's first httpx call paid its own imports and connection (0.6 s once),
    # which is the client's first use, not the server's: one /health (which start already
    # polled) before the timed requests.
    httpx.get(f"{url}/health", timeout=10)
    try:
        rows.append(row("after start", series(url, args.requests, args.max_tokens, args.idle)))
        rows[-1]["start_s"] = round(start_s, 1)
        last = int((ROOT / "run" / f"rank-{args.ranks - 1}.pid").read_text())
        os.kill(last, signal.SIGKILL)
        killed = time.monotonic()
        time.sleep(1.0)  # the supervisor notices; /health turns 503
        wait_ready(url, 600)
        restart_s = time.monotonic() - killed
        rows.append(
            row(
                "after a supervisor restart", series(url, args.requests, args.max_tokens, args.idle)
            )
        )
        rows[-1]["restart_s"] = round(restart_s, 1)
    finally:
        server.stop()
    text = server_log.read_text(errors="replace")[offset:]
    for entry, seconds in zip(rows, warmups(text), strict=False):
        entry["warm_up_s"] = seconds
    cache = "warm" if args.warm_cache else "empty"
    log(f"{args.ranks} rank(s), MLX kernel cache {cache} at start:")
    for entry in rows:
        log(json.dumps(entry))
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
