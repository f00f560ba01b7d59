"""What the ranks tell each other of their machines and the link, and what status keeps:
a measured Machine or Speed as a JSON record and back, every rank's record gathered in one
all_gather, ranks on one host merged into one machine (distributed/step_probe.py measures
them), and a Speed as a log line."""

from __future__ import annotations

import json
import statistics
from typing import Any

import mlx.core as mx
import numpy as np

from distributed.chips import Chip, Link, chip_named
from distributed.hosts import RankHost
from distributed.step_model import Machine, Speed
from distributed.step_overhead import CPU_OVERHEAD, GPU_OVERHEAD

RECORD_BYTES = 2048  # a rank's record in the all_gather, JSON padded with zeros


def known_chip(name: str) -> Chip | None:
    try:
        return chip_named(name) if name else None
    except ValueError:
        return None


def machine_record(machine: Machine) -> dict[str, Any]:
    return {
        "name": machine.name,
        "memory_bytes": machine.memory_bytes,
        "cores": machine.cores,
        "rates": [[rows, round(rate, 3)] for rows, rate in machine.rates],
        "alone_rates": [[rows, round(rate, 3)] for rows, rate in machine.alone_rates],
        "head_rates": [[rows, round(rate, 3)] for rows, rate in machine.head_rates],
        "route_rates": [[rows, round(rate, 3)] for rows, rate in machine.route_rates],
        "flops_per_ms": round(machine.flops_per_ms, 1),
        "attention_flops_per_ms": round(machine.attention_flops_per_ms, 1),
        "kv_bytes_per_ms": round(machine.kv_bytes_per_ms, 1),
        "expert_flops_per_ms": round(machine.expert_flops_per_ms, 1),
        "row_layer_ms": round(machine.row_layer_ms, 5),
        "chip": machine.chip.name if machine.chip else "",
        "gpu": machine.overhead is GPU_OVERHEAD,
        "cpu": machine.cpu,
    }


def machine_from_record(record: dict[str, Any]) -> Machine:
    return Machine(
        name=record["name"],
        memory_bytes=int(record["memory_bytes"]),
        cores=int(record["cores"]),
        rates=tuple((int(rows), float(rate)) for rows, rate in record["rates"]),
        alone_rates=tuple((int(rows), float(rate)) for rows, rate in record.get("alone_rates", [])),
        head_rates=tuple((int(rows), float(rate)) for rows, rate in record.get("head_rates", [])),
        route_rates=tuple((int(r), float(rate)) for r, rate in record.get("route_rates", [])),
        flops_per_ms=float(record["flops_per_ms"]),
        attention_flops_per_ms=float(record.get("attention_flops_per_ms", 0.0)),
        kv_bytes_per_ms=float(record.get("kv_bytes_per_ms", 0.0)),
        expert_flops_per_ms=float(record.get("expert_flops_per_ms", 0.0)),
        row_layer_ms=float(record.get("row_layer_ms", 0.0)),
        chip=known_chip(record.get("chip", "")),
        overhead=GPU_OVERHEAD if record.get("gpu") else CPU_OVERHEAD,
        cpu=record.get("cpu", ""),
    )


def all_records(group: mx.distributed.Group, mine: dict[str, Any]) -> list[dict[str, Any]]:
    if group.size() == 1:
        return [mine]
    record = np.zeros(RECORD_BYTES, dtype=np.uint8)
    encoded = json.dumps(mine).encode()
    if len(encoded) > RECORD_BYTES:
        raise ValueError(f"a rank's speed record is {len(encoded)} bytes, over {RECORD_BYTES}")
    record[: len(encoded)] = np.frombuffer(encoded, dtype=np.uint8)
    gathered = mx.distributed.all_gather(mx.array(record), group=group)
    rows = np.array(gathered).reshape(group.size(), RECORD_BYTES)
    return [json.loads(row.tobytes().rstrip(b"\0")) for row in rows]


def speed_record(speed: Speed) -> dict[str, Any]:
    """A Speed as JSON (status; bench/step_model.py predicts again from it)."""
    link = speed.link
    return {
        "machines": [machine_record(m) for m in speed.machines],
        "link": [
            link.name,
            link.latency_us,
            link.gb_s,
            link.topology,
            link.bulk_bytes,
            link.bulk_gb_s,
        ],
        "crowding": list(speed.crowding),
        "rates_shared": speed.rates_shared,
        "crowded": [speed.crowded_hop_ms, speed.crowded_ms_per_mb, speed.pipeline_hop_ms],
    }


def speed_from_record(record: dict[str, Any]) -> Speed:
    name, latency, rate, topology, *bulk = record["link"]  # records before the bulk: 4
    bulk_bytes, bulk_gb_s = (float(b) for b in bulk) if bulk else (0.0, 0.0)
    # records before 2026-12-02 kept two figures, and none before 2026-12-01
    hop_ms, ms_per_mb, pipeline_hop_ms, *_ = (
        float(f) for f in [*record.get("crowded", ()), 0.0, 0.0, 0.0]
    )
    return Speed(
        tuple(machine_from_record(m) for m in record["machines"]),
        Link(name, float(latency), float(rate), topology, "recorded", bulk_bytes, bulk_gb_s),
        tuple(record.get("crowding", ())),
        bool(record.get("rates_shared", False)),
        hop_ms,
        ms_per_mb,
        pipeline_hop_ms,
    )


def per_host(records: list[dict[str, Any]], hosts: list[RankHost]) -> tuple[Machine, ...]:
    """Every rank's machine: ranks on one host share its record, the median of theirs
    (ranks taking turns on fewer cores measured widely different rates at one row, each
    alone; their median is what one of them gets; docs/BENCHMARKS.md, "Figures behind
    the code"). Their prefill's figures they timed at once, every rank alike
    (distributed/shared_cores.py)."""
    out = []
    for host in hosts:
        mine = [r["machine"] for r, h in zip(records, hosts, strict=True) if h.host == host.host]
        merged = dict(mine[0])
        for key in ("rates", "head_rates", "alone_rates", "route_rates"):
            merged[key] = [
                [rows, statistics.median(m[key][i][1] for m in mine)]
                for i, (rows, _) in enumerate(mine[0].get(key, []))
            ]
        for key in (
            "flops_per_ms",
            "attention_flops_per_ms",
            "kv_bytes_per_ms",
            "expert_flops_per_ms",
            "row_layer_ms",
        ):
            merged[key] = statistics.median(m.get(key, 0.0) for m in mine)
        out.append(machine_from_record(merged))
    return tuple(out)


def crowding_of(hosts: list[RankHost]) -> tuple[float, ...]:
    """Each rank's host's ranks over its cores."""
    return tuple(
        sum(1 for other in hosts if other.host == host.host) / max(1, host.cores) for host in hosts
    )


def describe_speed(speed: Speed) -> str:
    """One log line: each machine's rates and the link's cost."""
    parts = []
    for rank, m in enumerate(speed.machines):
        if m.rates:
            rates = dict(m.rates)
            parts.append(
                f"rank {rank} {m.name}: {rates.get(1, 0) / 1e6:.1f} GB/s at 1 row, "
                f"{rates.get(8, 0) / 1e6:.1f} at 8, {m.flops_per_ms / 1e6:.0f} GFLOP/s"
            )
        elif m.chip is not None:
            parts.append(
                f"rank {rank} {m.name}: {m.chip.bandwidth_gb_s:g} GB/s, {m.chip.gpu_tflops:g} "
                "TFLOPS (specified)"
            )
    parts.append(f"link {speed.link.name}: {speed.link.describe()}")
    return "step-time model: " + "; ".join(parts)
