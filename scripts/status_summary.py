"""Summarise rank 0's Status JSON (stdin) for `./launch.sh status`: state, plan, ranks.

Tolerant of missing fields: whatever is absent is left out. Standard library only.
"""

from __future__ import annotations

import json
import sys


def _span(value: object) -> str:
    if isinstance(value, list) and len(value) == 2:
        return f"{value[0]}-{value[1]}"
    return str(value)


def _parts(plan: dict) -> str:
    """What a tensor plan splits, e.g. ' by heads + experts + vocabulary'."""
    if not str(plan.get("strategy", "")).startswith("tensor"):
        return ""
    if plan.get("via_mlx_lm"):
        return " via mlx-lm's shard()"
    names = [
        name
        for key, name in (
            ("split_heads", "heads"),
            ("split_experts", "experts"),
            ("split_vocab", "vocabulary"),
        )
        if plan.get(key)
    ]
    return f" by {' + '.join(names)}" if names else ""


def summarise(status: dict) -> list[str]:
    """Lines describing the model, the plan and each rank."""
    plan = status.get("plan") or {}
    lines = [
        f"state {status.get('state', '?')}, model {status.get('model_id', '?')}, "
        f"backend {status.get('backend', '?')}, {status.get('world_size', '?')} rank(s), "
        f"plan {plan.get('strategy', '?')}{_parts(plan)} "
        f"(PARALLELISM={plan.get('requested', '?')}), "
        f"active {status.get('active_requests', 0)}, queued {status.get('queued_requests', 0)}"
    ]
    hosts = {r.get("rank"): r for r in status.get("ranks") or []}
    for share in plan.get("ranks") or []:
        rank = share.get("rank")
        parts = [f"rank {rank}"]
        if rank in hosts:
            parts.append(f"on {hosts[rank].get('host', '?')}")
        parts.append(f"weight {share.get('weight', '?')}")
        for key in ("kv_heads", "q_heads", "mlp_columns", "experts", "vocab", "layers"):
            if key in share and share[key] not in ([0, 0], (0, 0)):
                parts.append(f"{key} {_span(share[key])}")
        memory = hosts.get(rank, {}).get("memory_bytes")
        if memory:
            parts.append(f"memory {memory / 2**20:.0f} MiB")
        lines.append(", ".join(parts))
    return lines + step_times(status)


def step_times(status: dict) -> list[str]:
    """The step-time model's predictions beside the measured steps, and the link measured
    at start (rank 0's status.step_model)."""
    model = status.get("step_model") or {}
    predicted = model.get("predicted_decode_ms") or {}
    if not predicted:
        return []
    measured = model.get("measured_decode_ms") or {}
    rows = sorted(set(predicted) | set(measured), key=int)
    parts = []
    for row in rows:
        shown = measured.get(row)
        got = f"{shown:.1f}" if isinstance(shown, int | float) else "not yet"
        parts.append(f"{row} row(s) {predicted.get(row, 0):.1f} / {got} ms")
    lines = ["decode step, predicted / measured: " + ", ".join(parts)]
    if model.get("prefill_steps"):
        lines.append(
            f"prefill, predicted / measured: {model.get('predicted_prefill_tokens_per_s', 0):.0f}"
            f" / {model.get('measured_prefill_tokens_per_s', 0):.0f} tokens/s"
        )
    if model.get("expert_load"):
        lines.append(
            f"expert split: the busiest rank takes {model['expert_load']:.0%} of the routes"
        )
    if model.get("link"):
        lines.append(f"measured at start: {model['link']}")
    return lines


def main() -> int:
    text = sys.stdin.read()
    try:
        lines = summarise(json.loads(text))
    except (ValueError, AttributeError, TypeError):
        print(text.strip())
        return 0
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
