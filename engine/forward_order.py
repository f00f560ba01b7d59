"""One order for a step's forwards on every rank.

A step can hold several forwards evaluated together: the answers' decode, prompts'
chunks, a last chunk's rows and then its last token alone. MLX orders the independent
parts of an evaluation by the graph's shape, and ranks holding different shares (the
default model's 6 and 3 heads at 2 ranks) build graphs of different shapes: their
all_sums ran in different orders, summed arrays of different forwards, and a 481-token
prompt's answer, and every answer after it on that start, was gibberish (2026-11-29).
So each forward's tokens depend (`mx.depends`) on the last arrays of the forward before
it, and every collective of a step follows the one before it through the data. A model
whose every call evaluates its own collectives (a pipeline's stage) needs no links.
"""

from __future__ import annotations

import mlx.core as mx


class ForwardOrder:
    """The arrays the step's next forward must run after."""

    def __init__(self, linked: bool = True) -> None:
        self._last: list[mx.array] = []
        self.linked = linked

    def start_step(self) -> None:
        """The step's first forward: the step before was evaluated whole."""
        self._last = []

    def next(self, tokens: mx.array) -> mx.array:
        """`tokens` for a forward that runs after every forward before it."""
        return mx.depends([tokens], self._last)[0] if self._last and self.linked else tokens

    def ran(self, last: list[mx.array]) -> list[mx.array]:
        """A forward was built: `last`, its arrays computed after all its collectives (the
        logits; a forward read only through the cache: the cache's arrays)."""
        self._last = list(last)
        return last
