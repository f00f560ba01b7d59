"""Rank 0's record of its steps beside the step-time model's predictions, for status
(`./launch.sh status`, /cluster/status): predicted against measured, on the same steps.

Each decode step without prefill is predicted with its own rows, positions a row and
context (the model is linear in the context: distributed/step_model.py `ClusterModel`),
and both figures go into the last WINDOW steps of that row count; status shows their
medians, so a step that compiled a new shape does not move them. Prefill-only steps of at
least PREFILL_MIN tokens add their tokens and times (measured, and predicted forward by
forward).
"""

from __future__ import annotations

import statistics
from collections import deque

from distributed.expert_load import ExpertLoad, busiest_share
from distributed.speed_records import describe_speed, speed_record
from distributed.step_model import ClusterModel
from distributed.step_work import PlanWork
from ipc.status import StepModelStatus

WINDOW = 64  # steps of each row count kept
PREFILL_MIN = 64  # prefill steps of fewer tokens (a short prompt's whole prefill) left out
SHOWN_ROWS = (1, 8)  # predicted in status even before such a step ran
# expert shares (layers x experts) status carries at most: a rank-0 status poll every
# second would carry 15,360 for 60 layers of 256 experts
SHOWN_SHARES = 4096


class StepTimes:
    """Measured and predicted step times, by the rows a decode step ran."""

    def __init__(self, model: ClusterModel, load: ExpertLoad | None = None) -> None:
        self.model = model
        self.load = load  # an expert split's routes, which the model follows
        self._refreshed = 0  # routes counted when the model last took them
        self.decode: dict[int, deque[tuple[float, float, float]]] = {}
        self.prefills: deque[tuple[list[tuple[int, int]], float]] = deque(maxlen=8)
        self.prefill_tokens = 0
        self.prefill_ms = 0.0
        self.prefill_predicted_ms = 0.0
        self.prefill_steps = 0

    def decoded(self, rows: int, width: int, context: float, ms: float) -> None:
        """A decode step of `rows` requests, `width` positions each, `context` positions
        cached a request on average, that took `ms` (plan to flush)."""
        self._follow_routes()
        predicted = self.model.decode_ms(rows, width, context)
        key = rows * width
        self.decode.setdefault(key, deque(maxlen=WINDOW)).append((ms, predicted, context))

    def prefilled(self, pieces: list[tuple[int, int]], ms: float) -> None:
        """A step that only prefilled: forwards of (context, tokens), `ms` in all."""
        tokens = sum(count for _, count in pieces)
        if tokens < PREFILL_MIN:
            return
        self._follow_routes()
        self.prefill_tokens += tokens
        self.prefill_ms += ms
        self.prefill_predicted_ms += sum(
            self.model.prefill_ms(count, context) for context, count in pieces if count
        )
        self.prefill_steps += 1
        self.prefills.append((list(pieces), ms))

    def _follow_routes(self) -> None:
        """The model with the routes counted so far, when they are due."""
        if self.load is not None and self.load.due(self._refreshed):
            self.model = self.model.routed_as(self.load.shares())
            self._refreshed = self.load.seen

    def status(self) -> StepModelStatus:
        measured = {r: statistics.median(m for m, _, _ in s) for r, s in self.decode.items()}
        predicted = {r: statistics.median(p for _, p, _ in s) for r, s in self.decode.items()}
        context = {r: statistics.median(c for _, _, c in s) for r, s in self.decode.items()}
        for rows in SHOWN_ROWS:
            predicted.setdefault(rows, self.model.decode_ms(rows))
        line = describe_speed(self.model.speed).removeprefix("step-time model: ")
        work = self.model.work
        return StepModelStatus(
            machines=line.split("; ")[:-1],
            link=line.split("; ")[-1],
            predicted_decode_ms={r: round(ms, 2) for r, ms in sorted(predicted.items())},
            measured_decode_ms={r: round(ms, 2) for r, ms in sorted(measured.items())},
            decode_steps={r: len(s) for r, s in sorted(self.decode.items())},
            decode_context=context,
            speed=speed_record(self.model.speed)
            | {
                "activation_bytes": work.activation_bytes,
                "weight_bytes": [r.weight_bytes for r in work.ranks],
                "kv_bytes_per_token": [r.kv_bytes_per_token for r in work.ranks],
                "expert_shares": _shown(work.expert_shares),
            },
            expert_load=_busiest(work, self.load),
            prefill_forwards=list(self.prefills),
            predicted_prefill_tokens_per_s=_rate(self.prefill_tokens, self.prefill_predicted_ms),
            measured_prefill_tokens_per_s=_rate(self.prefill_tokens, self.prefill_ms),
            prefill_steps=self.prefill_steps,
        )


def _busiest(work: PlanWork, load: ExpertLoad | None) -> float:
    """An expert split's busiest rank's share of the routes counted so far (0: none)."""
    if load is None or not load.seen:
        return 0.0
    return round(busiest_share(load.shares(), [r.experts_held for r in work.ranks]), 3)


def _shown(shares: tuple[tuple[float, ...], ...]) -> list[list[float]]:
    """The model's expert shares as status carries them (bench/step_model.py predicts again
    from them): to 4 places, and none past SHOWN_SHARES numbers."""
    if sum(len(layer) for layer in shares) > SHOWN_SHARES:
        return []
    return [[round(x, 4) for x in layer] for layer in shares]


def _rate(tokens: int, ms: float) -> float:
    return round(1000.0 * tokens / ms, 1) if ms > 0 else 0.0
