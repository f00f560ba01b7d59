"""How many trailing positions the output head computes: one, except in a speculative step.

Every head the ranks use (engine/last_logits.py for an unsplit model, the vocabulary-parallel
heads, both pipeline forms) computes the logits of the last position only: the engine samples
nothing else. A speculative step (leader/speculation.py) feeds each decoding row its next
token and the tokens rank 0 proposed after it, and needs the logits of all those positions;
it runs its forward inside `computing(n)`. Every rank enters it with the same `n` (the step
plan carries the proposals), so the shapes the heads gather and the pipeline stages send and
receive agree across ranks. The value is read while the graph is built; the compiled decode
step (engine/compiled_decode.py) traces each width once, inside `computing(width)`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

_tail = 1


def tail() -> int:
    """Positions, counted from the end, whose logits the head computes now."""
    return _tail


@contextmanager
def computing(positions: int) -> Iterator[None]:
    """Heads compute the last `positions` positions inside this block."""
    global _tail
    if positions < 1:
        raise ValueError(f"a head computes at least one position, not {positions}")
    before, _tail = _tail, positions
    try:
        yield
    finally:
        _tail = before
