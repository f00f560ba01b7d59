"""Memory each rank needs under a plan, predicted before anything loads, and the check that
it fits each machine.

Weights: the loader's own slicing runs on a lazily loaded model with a stand-in group for
each rank; a lazy load reads only the safetensors headers (shapes and dtypes), so summing
the sliced parameters' sizes gives each rank's weight bytes exactly, without reading one
weight. KV cache: the family's cache kind and this rank's KV heads (tensor) or layers
(pipeline) give the bytes per token (the prefix cache measures the same figure on every
rank at start: engine/prefix_store.py); sliding-window layers add a fixed window per
sequence instead. A draft model (DRAFT_MODEL, leader/draft_model.py) counts on rank 0
alone: its whole weights (the safetensors' data sizes) and float KV of each sequence.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

from pydantic import BaseModel

from distributed.hosts import RankHost
from distributed.model_shape import FALLBACK_CONTEXT, PlanError, model_context
from distributed.plan import Plan, make_plan

# PREFIX_CACHE_BYTES by default: this share of the memory a rank has left after its
# weights (its machine's memory divided among the ranks on it). The rest stays for the
# running batch's KV (MAX_BATCH_SIZE sequences of the context) and the system.
PREFIX_SHARE = 0.25
# The shortest context a plan may leave each of MAX_BATCH_SIZE sequences: less is refused.
MIN_CONTEXT = 256
# KV_CACHE_BITS quantizes keys and values in groups of this many elements along a head
# (mlx-lm's QuantizedKVCache default; engine/quantized_kv.py).
KV_GROUP_SIZE = 64
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

    from distributed.splitting import split_model, weight_bytes

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


def draft_bytes(draft_dir: Path) -> tuple[int, int]:
    """A draft model's weight bytes (the sizes its safetensors headers give) and KV bytes
    per token (unsplit, float: rank 0 holds all of it as plain KV caches)."""
    config = json.loads((Path(draft_dir) / "config.json").read_text())
    weights = sum(
        info["data_offsets"][1] - info["data_offsets"][0] for info in _headers(draft_dir).values()
    )
    plan = make_plan(config, 1, None, "auto")
    per_token, _ = kv_bytes(plan, float(activation_bytes(draft_dir, config)))[0]
    return weights, per_token


def activation_bytes(model_dir: Path, config: dict) -> int:
    """Bytes per element of the hidden state (and so of the KV cache): the dtype of the
    final norm's weight, which no quantization touches."""
    for name, info in _headers(model_dir).items():
        if name.endswith("model.norm.weight") and info.get("dtype") in DTYPE_BYTES:
            return DTYPE_BYTES[info["dtype"]]
    named = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
    return {"float32": 4, "float64": 8}.get(named, 2)


def element_bytes(activation_bytes: int, bits: int | None) -> float:
    """Bytes a KV element takes: the activation dtype's, or `bits` plus its group's scale
    and bias (each of the activation dtype) shared by KV_GROUP_SIZE elements."""
    if bits is None:
        return float(activation_bytes)
    return bits / 8 + 2 * activation_bytes / KV_GROUP_SIZE


def kv_bytes(plan: Plan, element_bytes: float) -> list[tuple[int, int]]:
    """(bytes per token, bytes per sequence for sliding windows) of each rank's KV cache;
    `element_bytes` fractional where quantized."""
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
        window = sliding * per_layer * (s.sliding_window or 0)
        out.append((math.ceil(full * per_layer), math.ceil(window)))
    return out


def prefix_budget(setting: int | None, memory: int, ranks_on_host: int, weights: int) -> int:
    """A rank's prefix-cache bytes: PREFIX_CACHE_BYTES, or the default share."""
    if setting is not None:
        return setting
    return max(0, int(PREFIX_SHARE * (memory // max(1, ranks_on_host) - weights)))


def longest_context(free: int, sequences: int, per_token: int, per_sequence: int = 0) -> int | None:
    """The most tokens each of `sequences` sequences may hold in `free` bytes of KV; None
    where the caches do not grow per token (no bound)."""
    if per_token <= 0:
        return None
    return max(0, free - sequences * per_sequence) // (sequences * per_token)


class RankMemory(BaseModel):
    """One rank's predicted needs against what its machine offers it."""

    rank: int
    host: str
    weight_bytes: int
    kv_bytes_per_token: int
    kv_bytes: int  # for the configured batch of full sequences
    available_bytes: int  # its machine's memory divided among the ranks on it
    prefix_bytes: int = 0  # its prefix cache's budget
    longest_context: int | None = None  # at MAX_BATCH_SIZE, beside weights and prefix cache
    draft_weight_bytes: int = 0  # rank 0: DRAFT_MODEL's weights
    draft_kv_bytes_per_token: int = 0
    draft_kv_bytes: int = 0  # for the configured batch of full sequences

    @property
    def draft_bytes(self) -> int:
        return self.draft_weight_bytes + self.draft_kv_bytes

    @property
    def needed_bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes + self.draft_bytes

    @property
    def short_bytes(self) -> int:
        return max(0, self.needed_bytes - self.available_bytes)


class FitReport(BaseModel):
    """A plan and each rank's predicted memory; `describe()` prints it."""

    plan: Plan
    ranks: list[RankMemory]
    sequences: int  # MAX_BATCH_SIZE
    sequence_length: int  # MAX_SEQUENCE_LENGTH, or the model's context lowered to what fits
    kv_bits: int | None = None  # KV_CACHE_BITS
    draft_model: str = ""  # DRAFT_MODEL, on rank 0

    def problems(self) -> list[str]:
        short = [
            f"rank {r.rank} on {r.host} needs {_gib(r.needed_bytes)} (weights "
            f"{_gib(r.weight_bytes)} + KV {_gib(r.kv_bytes)}"
            f"{f' + draft model {_gib(r.draft_bytes)}' if r.draft_bytes else ''}) but has "
            f"{_gib(r.available_bytes)}:"
            f" short by {_gib(r.short_bytes)}"
            for r in self.ranks
            if r.short_bytes
        ]
        if self.sequence_length < MIN_CONTEXT:
            short.append(
                f"the ranks' memory leaves {self.sequence_length} tokens for each of "
                f"MAX_BATCH_SIZE={self.sequences} sequences, under {MIN_CONTEXT}"
            )
        return short

    def describe(self) -> list[str]:
        lines = [
            "memory per rank (weights from the safetensors headers; KV for MAX_BATCH_SIZE x "
            f"MAX_SEQUENCE_LENGTH = {self.sequences} x {self.sequence_length} tokens, "
            f"{'float' if self.kv_bits is None else f'{self.kv_bits} bits'} "
            "(KV_CACHE_BITS)):"
        ]
        for r in self.ranks:
            verdict = "fits" if not r.short_bytes else f"SHORT by {_gib(r.short_bytes)}"
            longest = "no bound" if r.longest_context is None else f"{r.longest_context} tokens"
            draft = (
                f" + draft model {_gib(r.draft_weight_bytes)} + its KV {_gib(r.draft_kv_bytes)}"
                f" ({r.draft_kv_bytes_per_token} bytes/token)"
                if r.draft_bytes
                else ""
            )
            lines.append(
                f"  rank {r.rank} on {r.host}: weights {_gib(r.weight_bytes)} + KV "
                f"{_gib(r.kv_bytes)} ({r.kv_bytes_per_token} bytes/token){draft} = "
                f"{_gib(r.needed_bytes)} of {_gib(r.available_bytes)}: {verdict}; longest "
                f"context at MAX_BATCH_SIZE={self.sequences}: {longest}"
            )
        if self.draft_model:
            lines.append(f"  draft model on rank 0 (DRAFT_MODEL): {self.draft_model}")
        return lines


class DoesNotFit(PlanError):
    """A plan some rank's machine cannot hold; `report` has every rank's figures."""

    def __init__(self, message: str, report: FitReport) -> None:
        super().__init__(message)
        self.report = report


def _gib(value: int) -> str:
    return f"{value / 2**30:.2f} GiB" if value >= 2**28 else f"{value / 2**20:.1f} MiB"


def predict(
    model_dir: Path,
    plan: Plan,
    hosts: list[RankHost],
    sequences: int,
    sequence_length: int | None,
    prefix_setting: int | None = None,
    kv_bits: int | None = None,
    draft_dir: Path | None = None,
) -> FitReport:
    """Each rank's figures; `sequence_length` None: the model's context, lowered to the
    longest every rank holds (as rank 0 chooses it: leader/context_window.py). `kv_bits`
    (KV_CACHE_BITS) applies where the ranks apply it: not to sliding-window models.
    `draft_dir`: DRAFT_MODEL's directory, whose weights and KV rank 0 holds too."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    draft_weights, draft_per_token = draft_bytes(draft_dir) if draft_dir else (0, 0)
    weights = predict_weight_bytes(model_dir, plan)
    bits = None if plan.shape.sliding_layers else kv_bits
    kv = kv_bytes(plan, element_bytes(activation_bytes(model_dir, config), bits))
    ranks = []
    for rank, host in enumerate(hosts):
        per_token, per_sequence = kv[rank]
        neighbours = sum(1 for other in hosts if other.host == host.host)
        available = host.memory_bytes // neighbours
        prefix = prefix_budget(prefix_setting, host.memory_bytes, neighbours, weights[rank])
        draft = (draft_weights, draft_per_token) if rank == 0 else (0, 0)  # rank 0's alone
        free = available - weights[rank] - prefix - draft[0]
        ranks.append(
            RankMemory(
                rank=rank,
                host=host.host,
                weight_bytes=weights[rank],
                kv_bytes_per_token=per_token,
                kv_bytes=0,
                available_bytes=available,
                prefix_bytes=prefix,
                longest_context=longest_context(
                    free, sequences, per_token + draft[1], per_sequence
                ),
                draft_weight_bytes=draft[0],
                draft_kv_bytes_per_token=draft[1],
            )
        )
    if sequence_length is None:
        bounds = [r.longest_context for r in ranks if r.longest_context is not None]
        sequence_length = min([model_context(config) or FALLBACK_CONTEXT, *bounds])
    for memory, (per_token, per_sequence) in zip(ranks, kv, strict=True):
        memory.kv_bytes = sequences * (per_token * sequence_length + per_sequence)
        memory.draft_kv_bytes = sequences * memory.draft_kv_bytes_per_token * sequence_length
    return FitReport(
        plan=plan,
        ranks=ranks,
        sequences=sequences,
        sequence_length=sequence_length,
        kv_bits=bits,
        draft_model=str(draft_dir or ""),
    )


def check_fit(
    model_dir: Path,
    hosts: list[RankHost],
    weights: list[float] | None,
    parallelism: str = "auto",
    sequences: int = 8,
    sequence_length: int | None = None,
    prefix_setting: int | None = None,
    kv_bits: int | None = None,
    draft_dir: Path | None = None,
) -> FitReport:
    """Plan the model in `model_dir` over one rank per entry of `hosts` and check that every
    rank's predicted weights plus the KV cache of `sequences` (MAX_BATCH_SIZE) sequences of
    `sequence_length` (MAX_SEQUENCE_LENGTH; None: the model's context, lowered to what the
    ranks hold beside their prefix caches) tokens fit its machine (its memory divided among
    the ranks on it); `draft_dir` (DRAFT_MODEL) adds its weights and KV to rank 0's. Reads
    config.json and the safetensors headers; loads no weight.
    Returns the plan and the per-rank figures (`FitReport.describe()`); raises PlanError
    naming the rank and the shortfall when a rank does not fit (DoesNotFit, which carries
    the report), or when the split itself is refused."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    plan = make_plan(config, len(hosts), weights, parallelism, hosts)
    report = predict(
        model_dir, plan, hosts, sequences, sequence_length, prefix_setting, kv_bits, draft_dir
    )
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
