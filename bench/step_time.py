"""Measure a cluster's steps beside its own step-time model: decode at 1 and 8 clients,
prefill, and one client's tokens a second.

    eval "$(.venv/bin/python -m launcher.command blas-env)"
    flock /tmp/mlxring-cpu.lock .venv/bin/python -m bench.step_time --ranks 2 \
        [--model DIR] [--batch 1 8] [--env PARALLELISM=pipeline SPECULATIVE=auto] \
        [--netns --delay-us 150 --gbps 10]

Starts the cluster (local ranks, or with `--netns` ranks 1.. in network namespaces behind a
delayed link: bench/netns_cluster.py), sends B identical greedy requests at once for each
batch size, then one prompt of `--prompt-tokens` alone, and reads rank 0's status: the
median decode step of each row count, measured and as the model predicted it for the same
steps (distributed/step_model.py, from the rates and link the ranks measured at start),
and the prefill tokens a second both ways. Prints one JSON report; bench/step_model.py
turns reports into docs/BENCHMARKS.md's table.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from distributed.hosts import usable_cores
from ipc.protocol import Done, SamplingParams, Submit
from launcher.local_cluster import Cluster

# a batch's rows open differently: identical greedy rows route every token to the same
# experts, 4 of the MoE model's 16 a layer at 8 clients where the model expects 14 of
# real traffic (its 8-client steps read 33-66% over the prediction so); stories all, which
# the default model runs on past 40 tokens (a recipe's opening ended in 2)
OPENINGS = tuple(
    f"Once upon a time{end}"
    for end in (
        "", ", a king", ", in a small village", " there lived a fox", ", far away",
        ", two friends", ", the sea", ", an old man",
    )
)  # fmt: skip
REPEATING = "one two three four five six seven eight nine ten " * 6  # prompt lookup proposes


def run_batch(cluster: Cluster, batch: int, max_tokens: int, prompt: str = "") -> list[Done]:
    """`batch` greedy requests sent at once (`prompt`, or each its own opening); their
    Done messages."""
    done: list[Done] = []
    with cluster.client(timeout=900) as client:
        for i in range(batch):
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
            text = prompt or OPENINGS[i % len(OPENINGS)]
            client.send(
                Submit(id=f"b{batch}-{i}-{time.monotonic_ns()}", prompt=text, params=params)
            )
        while len(done) < batch:
            message = client.recv()
            if isinstance(message, Done):
                done.append(message)
    return done


@contextmanager
def started(args: argparse.Namespace, env: dict[str, str]) -> Iterator[Cluster]:
    if args.netns:
        from bench.netns_cluster import NetnsCluster

        with NetnsCluster(
            args.model, args.ranks, env, delay_us=args.delay_us, gbps=args.gbps
        ) as cluster:
            yield cluster
    else:
        with Cluster(args.model, ranks=args.ranks, env=env, ready_timeout=900) as cluster:
            yield cluster


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--max-tokens", type=int, default=40)
    parser.add_argument("--prompt-tokens", type=int, default=1000, help="the prefill's prompt")
    parser.add_argument("--env", nargs="*", default=[])
    parser.add_argument("--netns", action="store_true", help="ranks 1.. in namespaces")
    parser.add_argument("--delay-us", type=float, default=0.0, help="one-way, each link")
    parser.add_argument("--gbps", type=float, default=0.0, help="bandwidth cap (0: none)")
    args = parser.parse_args()
    env = {"MAX_BATCH_SIZE": str(max(args.batch)), "SPECULATIVE": "off", "KEEP_WARM_SECONDS": "0"}
    env |= dict(item.split("=", 1) for item in args.env)
    report: dict[str, Any] = {"ranks": args.ranks, "model_dir": args.model or "default", "env": env}
    report |= {"delay_us": args.delay_us, "gbps": args.gbps, "cores": usable_cores()}
    with started(args, env) as cluster:
        status = cluster.status()
        report["plan"] = status.plan
        report["strategy"] = status.plan.get("strategy", "single")
        report["note"] = status.plan.get("note", "")
        report["weight_bytes"] = [rank.weight_bytes for rank in status.ranks]
        run_batch(cluster, 1, 8)  # compile the shapes first
        for batch in args.batch:
            run_batch(cluster, batch, args.max_tokens)
        text = " ".join(f"word{i % 97}" for i in range(args.prompt_tokens // 2))
        run_batch(cluster, 1, 1, prompt=text)
        model = cluster.status().step_model
        report["model"] = model.model_dump(mode="json")
        report["one_client"] = _one_client(cluster, args.max_tokens)
        report["decode"] = {
            str(b): {
                "predicted_ms": model.predicted_decode_ms.get(b),
                "measured_ms": model.measured_decode_ms.get(b),
                "steps": model.decode_steps.get(b, 0),
            }
            for b in args.batch
        }
        report["prefill"] = {
            "predicted_tokens_per_s": model.predicted_prefill_tokens_per_s,
            "measured_tokens_per_s": model.measured_prefill_tokens_per_s,
            "steps": model.prefill_steps,
        }
    if args.netns:
        report["relay"] = cluster.relay_report()  # type: ignore[attr-defined]
    print(json.dumps(report, indent=2))


def _one_client(cluster: Cluster, max_tokens: int) -> dict[str, Any]:
    """One client's tokens a second on a prompt that prompt lookup can continue, under the
    cluster's SPECULATIVE (off unless `--env SPECULATIVE=auto`)."""
    done = run_batch(cluster, 1, max_tokens, prompt=REPEATING)[0]
    timings = done.timings
    return {
        "tokens_per_s": round(timings.generation_tokens_per_second, 2),
        "proposed": timings.proposed_tokens,
        "accepted": timings.accepted_tokens,
        "steps": timings.decode_steps,
    }


if __name__ == "__main__":
    main()
