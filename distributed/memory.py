"""Memory each rank needs under a plan, predicted before anything loads, and the check that
it fits each machine.

Weights: the loader's own slicing runs on a lazily loaded model with a stand-in group for
each rank; a lazy load reads only the safetensors headers (shapes and dtypes), so summing
the sliced parameters' sizes gives each rank's weight bytes exactly, without reading one
weight. KV cache: the family's cache kind and this rank's KV heads (tensor) or layers
(pipeline) give the bytes per token (the prefix cache measures the same figure on every
rank at start: engine/prefix_store.py); sliding-window layers add a fixed window per
sequence instead.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from pydantic import BaseModel

from distributed.hosts import RankHost
from distributed.model_shape import PlanError
from distributed.plan import Plan, make_plan

DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1}


class StandInGroup:
    """The rank and size a sharder reads while slicing; it never runs a collective."""

    def __init__(self, rank: int, size: int) -> None:
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


def predict_weight_bytes(model_dir: Path, plan: Plan, ranks: list[int] | None = None) -> list[int]:
    """The weight bytes of each of `ranks` (default: every rank) under `plan`, from the
    headers alone."""
    from mlx_lm.utils import load_model

    from distributed.loader import split_model, weight_bytes

    out = []
    for rank in range(plan.world_size) if ranks is None else ranks:
        model, _ = load_model(Path(model_dir), lazy=True)
        group = StandInGroup(rank, plan.world_size)
        out.append(weight_bytes(split_model(model, plan, group)))  # type: ignore[arg-type]
    return out


def _headers(model_dir: Path) -> dict[str, dict]:
    tensors: dict[str, dict] = {}
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        with open(file, "rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            tensors.update(json.loads(handle.read(length)))
    tensors.pop("__metadata__", None)
    return tensors


def activation_bytes(model_dir: Path, config: dict) -> int:
    """Bytes per element of the hidden state (and so of the KV cache): the dtype of the
    final norm's weight, which no quantization touches."""
    for name, info in _headers(model_dir).items():
        if name.endswith("model.norm.weight") and info.get("dtype") in DTYPE_BYTES:
            return DTYPE_BYTES[info["dtype"]]
    named = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
    return {"float32": 4, "float64": 8}.get(named, 2)


def kv_bytes(plan: Plan, element_bytes: int) -> list[tuple[int, int]]:
    """(bytes per token, bytes per sequence for sliding windows) of each rank's KV cache."""
    s = plan.shape
    out = []
    for share in plan.ranks:
        groups = share.kv_heads[1] - share.kv_heads[0]
        if plan.via_mlx_lm and plan.is_tensor:
            groups = s.num_kv_heads // plan.world_size
        per_layer = (groups * s.kv_elements_per_group + s.kv_elements_shared) * element_bytes
        local = range(*share.layers)
        sliding = sum(1 for i in local if i in s.sliding_layers)
        full = len(local) - sliding
        out.append((full * per_layer, sliding * per_layer * (s.sliding_window or 0)))
    return out


class RankMemory(BaseModel):
    """One rank's predicted needs against what its machine offers it."""

    rank: int
    host: str
    weight_bytes: int
    kv_bytes_per_token: int
    kv_bytes: int  # for the configured batch of full sequences
    available_bytes: int  # its machine's memory divided among the ranks on it

    @property
    def needed_bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes

    @property
    def short_bytes(self) -> int:
        return max(0, self.needed_bytes - self.available_bytes)


class FitReport(BaseModel):
    """A plan and each rank's predicted memory; `describe()` prints it."""

    plan: Plan
    ranks: list[RankMemory]
    sequences: int  # MAX_BATCH_SIZE
    sequence_length: int  # MAX_SEQUENCE_LENGTH

    def problems(self) -> list[str]:
        return [
            f"rank {r.rank} on {r.host} needs {_gib(r.needed_bytes)} (weights "
            f"{_gib(r.weight_bytes)} + KV {_gib(r.kv_bytes)}) but has {_gib(r.available_bytes)}:"
            f" short by {_gib(r.short_bytes)}"
            for r in self.ranks
            if r.short_bytes
        ]

    def describe(self) -> list[str]:
        lines = [
            "memory per rank (weights from the safetensors headers; KV for MAX_BATCH_SIZE x "
            f"MAX_SEQUENCE_LENGTH = {self.sequences} x {self.sequence_length} tokens):"
        ]
        for r in self.ranks:
            verdict = "fits" if not r.short_bytes else f"SHORT by {_gib(r.short_bytes)}"
            lines.append(
                f"  rank {r.rank} on {r.host}: weights {_gib(r.weight_bytes)} + KV "
                f"{_gib(r.kv_bytes)} ({r.kv_bytes_per_token} bytes/token) = "
                f"{_gib(r.needed_bytes)} of {_gib(r.available_bytes)}: {verdict}"
            )
        return lines


class DoesNotFit(PlanError):
    """A plan some rank's machine cannot hold; `report` has every rank's figures."""

    def __init__(self, message: str, report: FitReport) -> None:
        super().__init__(message)
        self.report = report


def _gib(value: int) -> str:
    return f"{value / 2**30:.2f} GiB" if value >= 2**28 else f"{value / 2**20:.1f} MiB"


def predict(
    model_dir: Path, plan: Plan, hosts: list[RankHost], sequences: int, sequence_length: int
) -> FitReport:
    config = json.loads((Path(model_dir) / "config.json").read_text())
    weights = predict_weight_bytes(model_dir, plan)
    kv = kv_bytes(plan, activation_bytes(model_dir, config))
    ranks = []
    for rank, host in enumerate(hosts):
        per_token, per_sequence = kv[rank]
        neighbours = sum(1 for other in hosts if other.host == host.host)
        ranks.append(
            RankMemory(
                rank=rank,
                host=host.host,
                weight_bytes=weights[rank],
                kv_bytes_per_token=per_token,
                kv_bytes=sequences * (per_token * sequence_length + per_sequence),
                available_bytes=host.memory_bytes // neighbours,
            )
        )
    return FitReport(plan=plan, ranks=ranks, sequences=sequences, sequence_length=sequence_length)


def check_fit(
    model_dir: Path,
    hosts: list[RankHost],
    weights: list[float] | None,
    parallelism: str = "auto",
    sequences: int = 8,
    sequence_length: int = 4096,
) -> FitReport:
    """Plan the model in `model_dir` over one rank per entry of `hosts` and check that every
    rank's predicted weights plus the KV cache of `sequences` (MAX_BATCH_SIZE) sequences of
    `sequence_length` (MAX_SEQUENCE_LENGTH) tokens fit its machine (its memory divided among
    the ranks on it). Reads config.json and the safetensors headers; loads no weight.
    Returns the plan and the per-rank figures (`FitReport.describe()`); raises PlanError
    naming the rank and the shortfall when a rank does not fit (DoesNotFit, which carries
    the report), or when the split itself is refused."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    plan = make_plan(config, len(hosts), weights, parallelism, hosts)
    report = predict(model_dir, plan, hosts, sequences, sequence_length)
    problems = report.problems()
    if problems:
        raise DoesNotFit("; ".join(problems) + ". What would work: " + _remedy(report), report)
    return report


def _remedy(report: FitReport) -> str:
    total_needed = sum(r.needed_bytes for r in report.ranks)
    total_available = sum(r.available_bytes for r in report.ranks)
    if total_needed <= total_available:
        return (
            "RANK_WEIGHTS=auto (shares by memory) or weights that give the short ranks less; "
            "or lower MAX_BATCH_SIZE / MAX_SEQUENCE_LENGTH"
        )
    return (
        f"the ranks together need {_gib(total_needed)} and have {_gib(total_available)}: add "
        "ranks (machines), use a more quantized model, or lower MAX_BATCH_SIZE / "
        "MAX_SEQUENCE_LENGTH"
    )
