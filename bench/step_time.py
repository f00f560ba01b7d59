"""Measure the step loop: decode step time per batch size, collective share, idle CPU.

    LD_PRELOAD=.../libopenblas.so.0 .venv/bin/python -m bench.step_time --ranks 2 \
        --model /path/to/mlx_dir --batch 1 8 [--env IMPORT_DTYPE=float32]

Starts a local cluster (launcher.local_cluster) with LOG_LEVEL=DEBUG, sends B identical
greedy requests at once for each batch size, and reads rank 0's per-step debug lines.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import time

from bench.idle_cost import CpuWindow
from ipc.protocol import Done, SamplingParams, Submit
from launcher.local_cluster import Cluster

STEP = re.compile(
    r"step (\d+): decode (\d+), prefill (\d+) tokens; total ([\d.]+) ms = plan\+broadcast "
    r"([\d.]+) \(all_sum ([\d.]+)\) \+ build ([\d.]+) \+ stream ([\d.]+) \+ wait ([\d.]+) "
    r"\(all_sum ([\d.]+) in (\d+)\) \+ take ([\d.]+)"
)
WOKE = re.compile(r"woke the workers at ([\d.]+)")
WOKEN = re.compile(r"(r\d+) DEBUG woken at ([\d.]+)")


def idle_cpu(cluster: Cluster, seconds: float) -> dict[str, float]:
    """% of one core used by each rank and by mlx.launch while idle (the cluster leads its
    own process group)."""
    window = CpuWindow([cluster.process.pid])
    time.sleep(seconds)
    return {name: round(share * 100, 2) for name, share in window.shares().by_process.items()}


def run_batch(cluster: Cluster, batch: int, max_tokens: int) -> None:
    with cluster.client(timeout=600) as client:
        for i in range(batch):
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
            client.send(Submit(id=f"b{batch}-{i}", prompt="Once upon a time", params=params))
        done = 0
        while done < batch:
            done += isinstance(client.recv(), Done)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--idle-seconds", type=float, default=10.0)
    parser.add_argument("--env", nargs="*", default=[])
    parser.add_argument(
        "--profile-collectives",
        action="store_true",
        help="time each in-forward all_sum (adds sync points; separate run from step times)",
    )
    args = parser.parse_args()
    env = {"LOG_LEVEL": "DEBUG", "MAX_BATCH_SIZE": str(max(args.batch))}
    if args.profile_collectives:
        env["RING_PROFILE_COLLECTIVES"] = "1"
    env |= dict(item.split("=", 1) for item in args.env)
    report: dict = {"ranks": args.ranks, "model": args.model or "default"}
    with Cluster(args.model, ranks=args.ranks, env=env, ready_timeout=600) as cluster:
        # OpenBLAS's own default is a thread per core
        report["cores"] = os.cpu_count() or 1
        report["threads"] = int(cluster.environment().get("OPENBLAS_NUM_THREADS", report["cores"]))
        time.sleep(1.0)
        status = cluster.status()
        report["strategy"] = status.plan.get("strategy", "single")
        report["weight_bytes"] = [rank.weight_bytes for rank in status.ranks]
        report["idle_cpu_percent"] = idle_cpu(cluster, args.idle_seconds)
        for batch in args.batch:
            mark = len(cluster.log_path.read_text())
            run_batch(cluster, batch, args.max_tokens)
            time.sleep(0.5)
            log = cluster.log_path.read_text()[mark:]
            steps = [m for m in STEP.finditer(log) if int(m[2]) == batch and int(m[3]) == 0]
            if not steps:
                continue

            def median(i: int, rows=steps) -> float:
                return round(statistics.median(float(m[i]) for m in rows), 3)

            report[f"batch_{batch}"] = {
                "decode_steps": len(steps),
                "step_ms": median(4),
                "plan_broadcast_ms": median(5),
                "broadcast_all_sum_ms": median(6),
                "graph_build_ms": median(7),  # forward and sampling ops, Python
                "stream_ms": median(8),  # the last step's text, overlapping the compute
                "wait_ms": median(9),  # the rest of the compute after that
                "forward_all_sum_ms": median(10),
                "forward_all_sums": int(median(11)),
                "take_ms": median(12),  # the sampled tokens to Python, EOS and limits
            }
        log = cluster.log_path.read_text()
    woke = sorted(float(m[1]) for m in WOKE.finditer(log))
    latencies = []
    for match in WOKEN.finditer(log):
        earlier = [t for t in woke if t <= float(match[2])]
        if earlier:
            latencies.append((float(match[2]) - earlier[-1]) * 1e3)
    if latencies:
        report["wake_latency_ms"] = {"max": round(max(latencies), 3), "count": len(latencies)}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
