"""Which split is fastest on these machines and this link, and how fast: every split the
planner allows, with its predicted decode at 1 and 8 clients, prefill and longest
context, best first (`./launch.sh plan`); and PARALLELISM=auto's choice, the split that fits
with the best balance of the three speeds, with the reason for the log. A restart keeps
the split that ran before it (distributed/kept_split.py).

Predictions come from the step-time model (distributed/step_model.py) over each split's
work (distributed/step_work.py); memory from the same rules as the memory check
(distributed/memory.py: each rank's machine memory shared among its ranks, the prefix
cache's share, KV for MAX_BATCH_SIZE sequences). Weights are the shape's parameter counts,
scaled to the safetensors' real bytes where a model directory is at hand.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from distributed.hosts import RankHost
from distributed.memory import (
    MIN_CONTEXT,
    element_bytes,
    kv_bytes,
    longest_context,
    predict_weight_bytes,
    prefix_budget,
)
from distributed.model_shape import FALLBACK_CONTEXT, PlanError, model_context
from distributed.plan import Plan, make_plan
from distributed.step_model import Speed, StepTime, predict
from distributed.step_work import PlanWork, plan_work

CLIENTS = (1, 8)  # decode figures at 1 and 8 clients
PREFILL_CHUNK = 512  # a prompt alone prefills in chunks this long (its figure)
# the prompt of the prefill figure: an agent's (Claude Code's first is 12.5K tokens), long
# enough that attention over the cache weighs in it as it does in theirs
PREFILL_PROMPT = 8192
DECODE_CONTEXT = 512  # positions each decoding row has cached (attention's reads)


@dataclass(frozen=True)
class SplitSpeed:
    """One split and what it is predicted to do."""

    plan: Plan
    work: PlanWork
    steps: dict[int, StepTime]  # decode step by clients
    prefill_tokens: int  # the prompt of the prefill figure (PREFILL_PROMPT, or less to fit)
    prefill_ms: float  # its prefill alone, chunk by chunk
    longest_context: int | None  # None: no per-token KV (no bound)
    why_not: str = ""  # why it does not fit ("" when it does)

    @property
    def ranks(self) -> int:
        return self.plan.world_size

    def decode_tokens_per_s(self, clients: int) -> float:
        return 1000.0 * clients / self.steps[clients].ms

    @property
    def prefill_tokens_per_s(self) -> float:
        return 1000.0 * self.prefill_tokens / self.prefill_ms

    @property
    def name(self) -> str:
        if self.plan.strategy == "single":
            return "1 rank"
        kind = "tensor" if self.plan.is_tensor else "pipeline"
        if self.plan.is_tensor and self.plan.shape.is_moe:
            kind = "expert" if not self.plan.split_heads else "tensor+expert"
        return f"{self.ranks} ranks {kind}"


def _fit(
    plan: Plan,
    work: PlanWork,
    hosts: list[RankHost],
    config: dict,
    sequences: int,
    activation: int,
    kv_bits: int | None,
    prefix_setting: int | None,
) -> tuple[int | None, str]:
    """(longest context every rank holds at `sequences` sequences, why it does not fit)."""
    bits = None if plan.shape.sliding_layers else kv_bits
    kv = kv_bytes(plan, element_bytes(activation, bits))
    bounds = []
    for rank, host in enumerate(hosts):
        neighbours = sum(1 for other in hosts if other.host == host.host)
        available = host.memory_bytes // neighbours
        weights = int(work.ranks[rank].weight_bytes)
        prefix = prefix_budget(prefix_setting, host.memory_bytes, neighbours, weights)
        if weights > available:
            return 0, (
                f"rank {rank} ({host.host}) needs {weights / 2**30:.1f} GiB of weights, has "
                f"{available / 2**30:.1f} GiB"
            )
        per_token, per_sequence = kv[rank]
        longest = longest_context(available - weights - prefix, sequences, per_token, per_sequence)
        if longest is not None:
            bounds.append(longest)
    context = min([model_context(config) or FALLBACK_CONTEXT, *bounds])
    if context < MIN_CONTEXT:
        return (
            context,
            f"{context} tokens of context for {sequences} sequences, under {MIN_CONTEXT}",
        )
    return context, ""


def measure_split(
    plan: Plan,
    hosts: list[RankHost],
    speed: Speed,
    config: dict,
    activation: int,
    *,
    model_dir: Path | None = None,
    sequences: int = 8,
    kv_bits: int | None = None,
    prefix_setting: int | None = None,
) -> SplitSpeed:
    """One plan's predicted figures on `speed` (its machines: one per rank of `plan`)."""
    bits = None if plan.shape.sliding_layers else kv_bits
    per_token = [float(t) for t, _ in kv_bytes(plan, element_bytes(activation, bits))]
    work = plan_work(plan, activation, per_token)
    if model_dir is not None and any(Path(model_dir).glob("*.safetensors")):
        work = work.calibrated(predict_weight_bytes(Path(model_dir), plan))
    context, why = _fit(plan, work, hosts, config, sequences, activation, kv_bits, prefix_setting)
    steps = {c: predict(work, speed, c, context=DECODE_CONTEXT) for c in CLIENTS}
    prompt = min(PREFILL_PROMPT, context or PREFILL_PROMPT)
    prefill_ms = sum(
        predict(work, speed, 1, context=start, prefill=min(PREFILL_CHUNK, prompt - start)).ms
        for start in range(0, prompt, PREFILL_CHUNK)
    )
    return SplitSpeed(plan, work, steps, prompt, prefill_ms, context, why)


def splits(
    config: dict,
    hosts: list[RankHost],
    weights: Callable[[list[RankHost]], list[float] | None],
    speed_for: Callable[[int], Speed],
    activation: int,
    **options: object,
) -> list[SplitSpeed]:
    """Every split of the model over the first 1..N of `hosts` that the planner allows,
    best first: those that fit by their balance of the three speeds (`balance`), then
    those that do not.
    `weights(hosts)`: the rank weights for those hosts; `speed_for(n)`: machines and link
    for the first n."""
    out: list[SplitSpeed] = []
    for count in range(1, len(hosts) + 1):
        some = hosts[:count]
        kinds = ["auto"] if count == 1 else ["tensor", "pipeline"]
        for kind in kinds:
            try:
                plan = make_plan(config, count, weights(some), kind, some)
            except PlanError:
                continue
            out.append(
                measure_split(plan, some, speed_for(count), config, activation, **options)  # type: ignore[arg-type]
            )
    fitting = [o for o in out if not o.why_not] or out
    return sorted(out, key=lambda o: (bool(o.why_not), -balance(o, fitting)))


def speeds(option: SplitSpeed) -> tuple[float, float, float]:
    """The three figures a user waits on: decode tokens/s at 1 and 8 clients, prefill's."""
    return (
        option.decode_tokens_per_s(CLIENTS[0]),
        option.decode_tokens_per_s(CLIENTS[-1]),
        option.prefill_tokens_per_s,
    )


def balance(option: SplitSpeed, options: list[SplitSpeed]) -> float:
    """The geometric mean of `option`'s three speeds, each over the best of `options`'
    (1: best at all three)."""
    best = [max(column) for column in zip(*map(speeds, options), strict=True)]
    shares = [mine / top for mine, top in zip(speeds(option), best, strict=True)]
    return float(math.prod(shares) ** (1 / len(shares)))


def choose(options: list[SplitSpeed]) -> tuple[SplitSpeed, str]:
    """The split that fits with the best balance of decode at 1 and 8 clients and prefill,
    and why, in words. Decode at 1 client alone chose a pipeline 6% ahead of a tensor split
    that prefilled a 20K-token prompt 2.5x faster (docs/BENCHMARKS.md)."""
    fitting = [o for o in options if not o.why_not] or options
    best = max(fitting, key=lambda o: balance(o, fitting))
    why = "; ".join(
        f"{o.name} {_figures(o)}" + (f" (does not fit: {o.why_not})" if o.why_not else "")
        for o in [best, *(o for o in options if o is not best)]
    )
    return best, f"predicted (decode at 1 client, at {CLIENTS[-1]}, prefill): {why}"


def _figures(option: SplitSpeed) -> str:
    one, many, prefill = speeds(option)
    return f"{one:.1f}, {many:.1f}, {prefill:.0f} tok/s"


def choose_plan(
    config: dict,
    weights: list[float] | None,
    parallelism: str,
    hosts: list[RankHost],
    speed: Speed,
    activation: int,
    kept: str = "",
) -> Plan:
    """make_plan, with PARALLELISM=auto taking the split the step-time model predicts
    best among those that fit (`choose`; the plan's note says why), or `kept` ("tensor" or
    "pipeline", the split that ran before a restart) where it fits. Every rank calls it with
    the same gathered figures and environment, so every rank chooses the same."""
    world = len(hosts)
    if parallelism != "auto" or world == 1:
        return make_plan(config, world, weights, parallelism, hosts)
    options = []
    for kind in ("tensor", "pipeline"):
        try:
            plan = make_plan(config, world, weights, kind, hosts)
        except PlanError:
            continue
        options.append(measure_split(plan, hosts, speed, config, activation))
    if len(options) < 2:
        return make_plan(config, world, weights, parallelism, hosts)
    best, why = choose(options)
    before = next((o for o in options if split_kind(o.plan) == kept and not o.why_not), None)
    if before is not None:
        best = before
        why = f"kept {before.name}, chosen before this restart (a start decides anew); {why}"
    return best.plan.model_copy(update={"requested": "auto", "note": f"auto: {why}"})


def split_kind(plan: Plan) -> str:
    """The kind of split PARALLELISM names: "tensor" or "pipeline"."""
    return "tensor" if plan.is_tensor else plan.strategy


def describe(options: list[SplitSpeed], sequences: int) -> list[str]:
    """The table `./launch.sh plan` prints, best first."""
    lines = [
        f"predicted speed (decode at 1 and {CLIENTS[-1]} clients with {DECODE_CONTEXT} "
        f"positions cached, prefill of a prompt of {PREFILL_PROMPT} tokens or the longest "
        f"that fits, in chunks of {PREFILL_CHUNK}; best first):",
        f"  {'split':<26} {'1 client':>10} {CLIENTS[-1]:>3} clients {'prefill':>11} "
        f"{'step ms':>8} {'of it links':>11}  longest context (x{sequences})",
    ]
    for o in options:
        context = "no bound" if o.longest_context is None else f"{o.longest_context} tokens"
        if o.why_not:
            context = f"does not fit: {o.why_not}"
        lines.append(
            f"  {o.name:<26} {o.decode_tokens_per_s(1):>7.1f} t/s {o.decode_tokens_per_s(8):>7.1f} "
            f"t/s {o.prefill_tokens_per_s:>7.0f} t/s {o.steps[1].ms:>8.1f} "
            f"{o.steps[1].collective_ms:>11.1f}  {context}"
        )
    return lines
