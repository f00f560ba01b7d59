"""Rank 0's prefill budget: how many prompt tokens the next step prefills.

Alone on the cluster (no answer decoding) a prompt prefills PREFILL_CHUNK_SIZE tokens a
step. Beside running answers each step earns the prefill (PREFILL_SLOWDOWN - 1) times a
decode step's time, a credit that a chunk's step and the decode-only step after it spend
by what they took beyond a decode step (or give back what they took less), so the
answers' mean inter-token latency grows by at most PREFILL_SLOWDOWN (2: the prefill gets
as much time as the decodes). A step's chunk is the most tokens the step-time model
predicts fit in the credit, at least the smallest chunk worth its forward (as many tokens
as cost what any forward at that context costs, at least MIN_CHUNK: `_worth`); while the
credit does not cover that chunk (a long context makes even a few tokens cost more than
one step's allowance) steps only decode, saving up to SAVED_STEPS steps' allowance or
that chunk's cost, whichever is more, so a prefill step's latency stays bounded.

The step-time model, fitted from rank 0's own steps: a decode step of B rows costs D(B),
the mean of the last QUIET_STEPS decode-only steps of B rows taken while no prompt waited
(a running average of every decode step misread a step's cost beside a waiting prompt;
the median, below the mean where a noisy host's steps run long now and then, charged
that noise to the prompt's steps alone: docs/BENCHMARKS.md); a prefill forward of c
tokens that starts at context position L costs f + g L + a c + b c (L + c / 2): a fixed
cost (the weights, the dispatch), reading the cache, a cost per token (the products), and
attention over the cache, which grows with the context and dominates a long prefill on a
CPU. The coefficients come from a least-squares fit, none negative, over recent prefill
steps (their time less the predicted decode part), weighted toward recent steps, over a
weak prior: the step-time model's prediction for this cluster (distributed/step_model.py
`prefill_coefficients`), or without one an optimistic guess; a chunk is never more than
twice the largest prefill forward measured, so the model is not trusted far beyond its
data (and steps of growing chunks give the fit the spread of sizes that tells the costs
apart). Every rank applies rank 0's number from the step plan; nothing here reads another
rank's clock.
"""

from __future__ import annotations

from collections import deque
from statistics import mean

import numpy as np

MIN_CHUNK = 16
QUIET_STEPS = 32  # decode-only steps, with no prompt waiting, a decode cost is the mean of
FORGET = 0.98  # weight the fit keeps of the past at each prefill step
SAVED_STEPS = 2  # the most steps' allowance the credit holds
# Features are scaled so the prior's weight means the same in each: per forward, per 10K
# cached positions a forward reads, per 100 tokens, per million token x position pairs.
_SCALE = np.array([1.0, 1e-4, 1e-2, 1e-6])
# The prior without a step-time model (ms), optimistic on purpose (the doubling cap limits
# a miss): 1 ms a forward and 1e-4 ms a cached position it reads, 0.05 ms a token, 5e-6 ms
# a token and cached position. Either prior weighs a tenth of a step.
_PRIOR = np.array([1.0, 1.0, 5.0, 5.0])
_PRIOR_WEIGHT = 0.1


def _features(pieces: list[tuple[int, int]]) -> np.ndarray:
    """Sum over a step's prefill forwards (context L, tokens c) of (1, L, c, c (L + c/2))."""
    total = np.zeros(4)
    for context, tokens in pieces:
        if tokens > 0:
            total += (1.0, context, tokens, tokens * (context + tokens / 2))
    return total * _SCALE


def _nonnegative_solve(gram: np.ndarray, moment: np.ndarray) -> np.ndarray:
    """The least-squares coefficients with none negative (a negative cost would let a
    chunk grow without bound): drop the negative ones and solve again for the rest."""
    keep = np.ones(len(moment), dtype=bool)
    solved = np.zeros(len(moment))
    while keep.any():
        solved[:] = 0.0
        solved[keep] = np.linalg.solve(gram[np.ix_(keep, keep)], moment[keep])
        if (solved >= 0).all():
            break
        keep &= solved > 0
    return solved


class PrefillBudget:
    """Step times measured by rank 0, and the prefill tokens a step may take."""

    def __init__(
        self,
        alone: int,
        slowdown: float,
        min_chunk: int = MIN_CHUNK,
        prior: tuple[float, float, float, float] | None = None,
    ) -> None:
        """`prior`: the step-time model's (ms a forward, a cached position, a token, a
        token x cached position)."""
        self.prior = _PRIOR if prior is None else np.array(prior) / _SCALE
        self.alone = alone
        self.slowdown = slowdown
        self.min_chunk = min(min_chunk, alone)
        self.quiet: dict[int, deque[float]] = {}  # decode-only step ms by rows, none waiting
        self.largest = 0  # the most tokens of one prefill forward measured
        self.credit = 0.0  # ms of prefill the answers have allowed and not yet spent
        self.after_chunk = False  # whether the last step prefilled
        self.worth_ms = 0.0  # what the smallest chunk worth its forward costs (`_worth`)
        self._gram = np.eye(4) * _PRIOR_WEIGHT
        self._moment = self.prior * _PRIOR_WEIGHT
        self.coefficients = self.prior.copy()

    # ---- measurements ------------------------------------------------------------

    def observe(
        self, rows: int, pieces: list[tuple[int, int]], ms: float, waiting: bool = False
    ) -> None:
        """A step's time: `rows` decoding rows and prefill forwards `pieces`; `waiting`: a
        prompt was waiting to prefill (the step's plan carried a budget)."""
        x = _features(pieces)
        after, self.after_chunk = self.after_chunk, bool(x.any())
        self.largest = max([self.largest, *(tokens for _, tokens in pieces)])
        decode_ms = self.decode(rows) if rows else None
        if decode_ms is not None:  # the answers allow (slowdown - 1) x their step each step
            allowance = (self.slowdown - 1.0) * decode_ms
            # a chunk's step spends its time beyond a quiet step's (or gives back what it
            # took less), and so does the decode-only step after it, which carries some of
            # its work; the other decode-only steps spend nothing, whatever the host did
            # to them (charged too, a phase of slow steps left the prompt no credit)
            spent = ms - decode_ms if x.any() or (waiting and after) else 0.0
            most = max(SAVED_STEPS * allowance, self.worth_ms)
            self.credit = min(most, self.credit + allowance - spent)
        if not x.any():
            if rows and not waiting:
                self.quiet.setdefault(rows, deque(maxlen=QUIET_STEPS)).append(ms)
                self.worth_ms = 0.0  # no prompt waits: the credit holds SAVED_STEPS' again
            return
        prefill_ms = ms - (decode_ms or 0.0)
        if prefill_ms <= 0:
            return
        prior_gram, prior_moment = np.eye(4) * _PRIOR_WEIGHT, self.prior * _PRIOR_WEIGHT
        self._gram = FORGET * (self._gram - prior_gram) + prior_gram + np.outer(x, x)
        self._moment = FORGET * (self._moment - prior_moment) + prior_moment + x * prefill_ms
        self.coefficients = _nonnegative_solve(self._gram, self._moment)

    def decode(self, rows: int) -> float | None:
        """A decode step's ms for `rows` rows (the nearest measured count's)."""
        if not self.quiet:
            return None
        near = min(self.quiet, key=lambda r: abs(r - rows))
        return mean(self.quiet[near])

    def predict(self, pieces: list[tuple[int, int]]) -> float:
        """Milliseconds the prefill forwards `pieces` add to a step."""
        return float(_features(pieces) @ self.coefficients)

    # ---- the decision ------------------------------------------------------------

    def tokens(self, rows: int, pending: list[tuple[int, int]]) -> int:
        """Prefill tokens for the next step (0: none, this step only decodes): `rows`
        decoding rows, and each prefilling sequence's (positions cached, tokens left) in
        the order the engine takes them."""
        if not rows:
            return self.alone
        if self.decode(rows) is None:
            return self.min_chunk  # no decode step measured yet: take the smallest chunk
        worth = self._worth(*pending[0])
        self.worth_ms = self.predict([(pending[0][0], worth)])
        if self.credit < self.worth_ms:
            return 0  # save the allowance of this step for a chunk worth its forward
        left, total = self.credit, 0
        for context, remaining in pending:
            take = self._fit(context, remaining, left)
            if take <= 0:
                break
            left -= self.predict([(context, take)])
            total += take
            if take < remaining:
                break
        return max(worth, min(self.alone, 2 * self.largest, total))

    def _worth(self, context: int, remaining: int) -> int:
        """The fewest tokens of a chunk at `context` worth its forward: as many as cost
        what the forward costs whatever its tokens (reading the cache, the dispatch), at
        least MIN_CHUNK, at most twice the largest forward measured. At 12-20K positions
        here 16 tokens cost about 8 ms beside 20 that any forward there costs."""
        f, g, a, b = self.coefficients * _SCALE
        per_token = a + b * context
        tokens = (f + g * context) / per_token if per_token > 0 else float(remaining)
        most = min(remaining, self.alone, max(self.min_chunk, 2 * self.largest))
        return int(min(most, max(self.min_chunk, tokens)))

    def _fit(self, context: int, remaining: int, ms: float) -> int:
        """The most tokens (up to `remaining`) one forward at `context` takes within `ms`."""
        f, g, a, b = self.coefficients * _SCALE
        room = ms - f - g * context
        if room <= 0:
            return 0
        # b/2 c^2 + (a + b L) c <= room
        linear = a + b * context
        if b > 0:
            c = (-linear + (linear * linear + 2 * b * room) ** 0.5) / b
        else:
            c = room / linear if linear > 0 else float(remaining)
        return int(min(remaining, max(0.0, c)))
