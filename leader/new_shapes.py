"""What a decode step costs when it makes the compiled decode trace a new shape, for the
speculation rule (leader/spec_rule.py).

engine/compiled_decode.py traces each (rows, positions, buffer) once, the buffer growing
by STEP positions, and keeps MAX_TRACES of them: a speculating answer traces each width it
uses at each buffer length it reaches. A traced step took 40-60 ms over a 50-110 ms step
on the Xeon host (docs/BENCHMARKS.md, "What a new cache length costs"), which the rule did
not price: a width tried once at a length paid a whole trace for a gain of a token or two.
Rank 0 follows the shapes as its plans make them (its rows, each step's width, and the
batch's cached positions: its longest row, which the others are padded to) and prices a
width new at this length at CHARGE of what such steps measured over their width's time.
Half, not the whole: a shape made now serves the steps after it at this length too.
Where the steps run eagerly nothing is traced, and the measured extra falls to about 0.

Replayed (bench/spec_replay.py, this host's measured step costs, a new shape 1.01 plain
steps) over the fifteen edit workloads, five edits of this repository's files and eight
free texts, the geometric mean of on/off read 1.82x uncharged, 1.84x charging a quarter,
1.86x half, 1.84x the whole; served, two alternated rounds of the fifteen, +1.5% and +11%
(docs/BENCHMARKS.md, "A new shape priced").
"""

from __future__ import annotations

from collections import OrderedDict

from distributed.overhead import MAX_TRACES
from engine.compiled_decode import buffer_size

CHARGE = 0.5  # of a new shape's measured extra, charged to the step that makes it


class NewShapes:
    """The shapes rank 0's plans made, the latest MAX_TRACES, and a new one's extra ms."""

    def __init__(self, keep: int = MAX_TRACES) -> None:
        self._made: OrderedDict[tuple[int, int, int], None] = OrderedDict()
        self.keep = keep
        # a new shape's step over its width's time, as StepCosts averages it (0 until one
        # is measured)
        self.extra_ms = 0.0

    @staticmethod
    def _shape(rows: int, width: int, cached: int) -> tuple[int, int, int]:
        return rows, width, buffer_size(cached + width)

    def price(self, rows: int, width: int, cached: int) -> float:
        """The ms a step of `rows` rows, `width` positions each, over `cached` positions
        is charged for the shape it would make (0: made already)."""
        return 0.0 if self._shape(rows, width, cached) in self._made else CHARGE * self.extra_ms

    def take(self, rows: int, width: int, cached: int) -> bool:
        """Record the step's shape; whether it was new."""
        shape = self._shape(rows, width, cached)
        new = shape not in self._made
        self._made[shape] = None
        self._made.move_to_end(shape)
        while len(self._made) > self.keep:
            self._made.popitem(last=False)
        return new
