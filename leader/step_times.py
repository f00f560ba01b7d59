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

from distributed.speed_records import speed_record
from distributed.step_model import ClusterModel, describe_speed
from ipc.status import StepModelStatus

WINDOW = 64  # steps of each row count kept
PREFILL_MIN = 64  # prefill steps of fewer tokens (a short prompt's whole prefill) left out
SHOWN_ROWS = (1, 8)  # predicted in status even before such a step ran


class StepTimes:
    """Measured and predicted step times, by the rows a decode step ran."""

    def __init__(self, model: ClusterModel) -> None:
        self.model = model
        self.decode: dict[int, deque[tuple[float, float, float]]] = {}
        self.prefills: deque[tuple[list[tuple[int, int]], float]] = deque(maxlen=8)
        self.prefill_tokens = 0
        self.prefill_ms = 0.0
        self.prefill_predicted_ms = 0.0
        self.prefill_steps = 0

    def decoded(self, rows: int, width: int, context: float, ms: float) -> None:
        """A decode step of `rows` requests, `width` positions each, `context` positions
        cached a request on average, that took `ms` (plan to flush)."""
        predicted = self.model.decode_ms(rows, width, context)
        key = rows * width
        self.decode.setdefault(key, deque(maxlen=WINDOW)).append((ms, predicted, context))

    def prefilled(self, pieces: list[tuple[int, int]], ms: float) -> None:
        """A step that only prefilled: forwards of (context, tokens), `ms` in all."""
        tokens = sum(count for _, count in pieces)
        if tokens < PREFILL_MIN:
            return
        self.prefill_tokens += tokens
        self.prefill_ms += ms
        self.prefill_predicted_ms += sum(
            self.model.prefill_ms(count, context) for context, count in pieces if count
        )
        self.prefill_steps += 1
        self.prefills.append((list(pieces), ms))

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
            },
            prefill_forwards=list(self.prefills),
            predicted_prefill_tokens_per_s=_rate(self.prefill_tokens, self.prefill_predicted_ms),
            measured_prefill_tokens_per_s=_rate(self.prefill_tokens, self.prefill_ms),
            prefill_steps=self.prefill_steps,
        )


def _rate(tokens: int, ms: float) -> float:
    return round(1000.0 * tokens / ms, 1) if ms > 0 else 0.0
