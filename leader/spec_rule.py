"""Rank 0's per-step rule for speculation: verify proposals only where the step's tokens
per millisecond rise.

A speculative step of B decoding rows, W positions each, sends B x W rows through every
weight product and the head, so it costs what a step of B x W rows costs (compiled or
eager as the engine's plain steps are: engine/compiled_decode.py takes several positions).
Its gain is the proposals accepted: a row whose proposal j is accepted with chance c_j
(given the ones before were) and that proposes d of them gains c_1 + c_1 c_2 + ... +
c_1...c_d tokens on average. Each step rank 0 picks the width W (1: no speculation) that
maximises (B + gains) / cost(B x W); rows propose at most W - 1 tokens. With a full batch
the rows alone fill the step's products and W = 1 wins unless acceptance is high.
Proposals from a draft model (leader/draft_model.py) are not free: each costs rank 0 one
forward of the draft before the step (its measured time), so a row the draft proposes d
tokens for adds d of those to the step's cost; a grammar's row adds its mask's measured
time for each (the mask of the position after it).

A chance is the mean of two pieces of evidence at hand: the row's recent trials
(`Evidence`: does this answer copy at all), and how often the cluster's proposals were
accepted where their match had held as long (`MatchOdds`: does this match go on). A
match of 2 tokens found a moment ago is often a common n-gram; one that has held for 30 is
a file being copied, and its next token is almost always accepted.

Costs: rank 0 measures its own decode steps (those without prefill), by rows and by
eager or compiled, as a running average. Until a row count is measured, the prior is the
step-time model's prediction for this cluster (distributed/step_model.py: the plan's
weights at the rates measured at start, its collectives at the link's measured cost),
scaled by the nearest measured count, and 7% more when eager (compiled decode is 5-10%
faster). Steps of more than MAX_ROWS rows are never chosen: the CPU host's few-row kernel
takes up to 16 rows, and nothing beyond was measured. A step that made the compiled decode
trace a new shape is measured apart, as what a new shape adds, and a width that would make
one is charged part of that (leader/new_shapes.py).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import accumulate
from operator import mul

from leader.new_shapes import NewShapes

EAGER = 1.07
MAX_ROWS = 16
AVERAGE = 0.2  # weight of a new measurement in the running average
PRIOR = 0.5  # a row's acceptance before any trial
RECENT = 0.3  # weight of a row's newest trial: its last 3-5 trials decide
DRIFT = 0.05  # toward PRIOR, each step a row had no trial
# the match lengths MatchOdds tells apart (a length counts in the last edge at or below it)
HELD_EDGES = (2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 64)
HELD_MEMORY = 256  # trials a length's odds remember: its counts halve past this many


@dataclass
class Figures:
    """Proposed and accepted tokens, and the decode steps that took them."""

    proposed: int = 0
    accepted: int = 0
    steps: int = 0  # steps that gave this row (or the cluster) tokens
    tokens: int = 0  # tokens those steps gave
    rejections: int = 0  # steps whose proposals were not all accepted

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def tokens_per_step(self) -> float:
        return self.tokens / self.steps if self.steps else 0.0


def _unmodelled(rows: int) -> float:
    """The prior without a step-time model (tools, unit tests): weights dominate, so 16
    rows cost twice one; only its ratios matter until a step is measured."""
    return 1.0 + rows / 16


class StepCosts:
    """Decode step times by (rows, eager), measured by rank 0, over the prior (`prior`:
    the step-time model's ms for a step of that many rows); steps of more than `max_rows`
    rows are never predicted to pay."""

    def __init__(
        self, max_rows: int = MAX_ROWS, prior: Callable[[int], float] | None = None
    ) -> None:
        self.measured: dict[tuple[int, bool], float] = {}
        self.max_rows = max_rows
        self.prior = prior or _unmodelled
        self.shapes = NewShapes()

    def observe(self, rows: int, eager: bool, ms: float, new_shape: bool = False) -> None:
        """A decode step's time; the average starts from the prediction, so one slow step
        (a first eager run allocating its buffers) does not rule a width out for good. A
        step that made a new shape measures what a new shape adds instead."""
        before = self.predict(rows, eager)
        if new_shape:
            self.shapes.extra_ms += AVERAGE * (max(0.0, ms - before) - self.shapes.extra_ms)
            return
        self.measured[(rows, eager)] = before + AVERAGE * (ms - before)

    def predict(self, rows: int, eager: bool) -> float:
        """Milliseconds a decode step of `rows` rows takes."""
        if (rows, eager) in self.measured:
            return self.measured[(rows, eager)]
        prior = self.prior(rows) * (EAGER if eager else 1.0)
        if not self.measured:
            return prior
        (near, near_eager), ms = min(
            self.measured.items(), key=lambda item: (abs(item[0][0] - rows), item[0][1] != eager)
        )
        return prior * ms / (self.prior(near) * (EAGER if near_eager else 1.0))


@dataclass
class Evidence:
    """A row's chance that a proposal is accepted given the ones before it were, from its
    latest trials: each moves the estimate RECENT of the way to its outcome, so a few
    rejections at the start (an answer that opens with prose) weigh nothing once the row
    copies again. Trials come free where the row was not verified: the token a step
    sampled is checked against what prompt lookup would have proposed for it (`shadow`
    in leader/speculation.py), so a row the rule left out keeps being measured and is let
    back in when it copies. With no trial in a step the estimate drifts back toward PRIOR
    (a draft model's rows, whose proposals cost a forward, are tried again in time).

    A lifetime average, (accepted + 1) / (accepted + rejections + 2), locked rows out: a
    400-token edit whose first proposals missed had 4 tokens proposed and none accepted,
    and proposed nothing more through the verbatim lines that followed (issue 37)."""

    rate: float = PRIOR

    def trial(self, accepted: bool) -> None:
        self.rate += RECENT * (float(accepted) - self.rate)

    def verified(self, kept: int, proposed: int) -> None:
        """A verified run: `kept` of `proposed` accepted (a run ends at its first miss)."""
        for _ in range(kept):
            self.trial(True)
        if kept < proposed:
            self.trial(False)

    def idle(self) -> None:
        self.rate += DRIFT * (PRIOR - self.rate)


class MatchOdds:
    """The cluster's odds that a prompt-lookup proposal is accepted, by how many tokens its
    match had held when it was proposed (its n-gram included; the j-th proposal of a
    step has held j - 1 more, if the ones before it are accepted). Counted from every
    verified proposal and shadow trial, the latest HELD_MEMORY of each length weighing,
    from a prior of one accepted in two.

    On the edit workloads' answers (bench/edit_workloads.py) a fresh 2-gram match's next
    token was accepted 69% of the time, one past 8 tokens 92-99%: a row's recent rate
    alone proposed a long match's continuation as timidly as a fresh one's. Fed both (their
    mean), the rule decoded each of the nine 1-17% faster at 1 rank (docs/BENCHMARKS.md,
    "Edits it was not tuned on")."""

    def __init__(self) -> None:
        self._accepted = [1.0] * len(HELD_EDGES)
        self._trials = [2.0] * len(HELD_EDGES)

    @staticmethod
    def _slot(held: int) -> int:
        return max(0, bisect_right(HELD_EDGES, held) - 1)

    def chance(self, held: int) -> float:
        slot = self._slot(held)
        return self._accepted[slot] / self._trials[slot]

    def trial(self, held: int, accepted: bool) -> None:
        slot = self._slot(held)
        self._accepted[slot] += accepted
        self._trials[slot] += 1
        if self._trials[slot] > HELD_MEMORY:
            self._accepted[slot] /= 2
            self._trials[slot] /= 2

    def chances(self, held: int, count: int, recent: float) -> list[float]:
        """Each of `count` proposals' chance for a match that has held `held` tokens, in a
        row whose recent rate is `recent`."""
        return [(self.chance(held + j) + recent) / 2 for j in range(count)]


def choose_width(
    chances: Sequence[Sequence[float]],
    costs: StepCosts,
    making: Sequence[float] | None = None,
    cached: int | None = None,
) -> int:
    """The step's positions per row (1: no speculation) for rows whose proposals have these
    chances (`chances[row][j]`: proposal j accepted, given the ones before it were; as
    many as the row proposes); `making`: each row's milliseconds to make one proposal
    (a draft model's forward, a grammar's mask; default 0, prompt lookup); `cached`: the
    batch's cached positions, where a width that would make a new compiled shape is priced
    for it (leader/new_shapes.py; None: not priced)."""
    rows = len(chances)
    making = making or [0.0] * rows

    def new(width: int) -> float:
        return 0.0 if cached is None else costs.shapes.price(rows, width, cached)

    best_width, best = 1, rows / (costs.predict(rows, eager=False) + new(1))
    for width in range(2, 2 + max(map(len, chances), default=0)):
        if rows * width > costs.max_rows:
            break
        gain = sum(sum(accumulate(row[: width - 1], mul)) for row in chances)
        made = sum(min(len(row), width - 1) * ms for row, ms in zip(chances, making, strict=True))
        value = (rows + gain) / (costs.predict(rows * width, eager=False) + made + new(width))
        if value > best:
            best_width, best = width, value
    return best_width
