"""How a pipeline streams a long prefill through its stages: the chunk in pieces.

A pipeline's forward runs its stages one after another, so during a prefill of one chunk
each rank waits for the ranks before it and then for the ones after it: with S stages a
rank works 1/S of the time. Cut into P pieces along the sequence, the chunk streams: stage
1 takes piece 2 while stage 2 takes piece 1, and the forward takes about (P + S - 1) / P of
one stage's time instead of S of them. Each piece still attends over the pieces before it
(the cache fills in order on every stage), so the result is the same forward, and a later
piece costs a stage more than an earlier one (`streamed_ms`).

A piece is at least MIN_PIECE tokens and a chunk takes at most PIECES_PER_STAGE pieces a
stage: the default model at 2 ranks prefilled a 1,000-token prompt at 237-246 tokens a
second whole, 368-371 in 4 pieces, 411-422 in 7 and 416-425 in 15 of 64 tokens (bench.
step_time, two runs each, 2026-11-29): past a few pieces a stage the bubble left is small
and a piece's fixed cost (a forward's dispatch in each layer) grows.
"""

from __future__ import annotations

MIN_PIECE = 128
PIECES_PER_STAGE = 4


def prefill_pieces(tokens: int, stages: int) -> int:
    """How many pieces a pipeline of `stages` stages cuts a prefill of `tokens` into (1:
    the chunk goes whole)."""
    if stages < 2:
        return 1
    return max(1, min(PIECES_PER_STAGE * stages, tokens // MIN_PIECE))


def streamed_ms(stage_piece_ms: list[list[float]]) -> float:
    """A forward's time when stage s takes `stage_piece_ms[s][k]` for piece k: each stage
    takes a piece once it has ended the one before and the stage before has handed it on.
    The later pieces attend over more of the cache and cost more, so the last stage's last
    piece, not an average one, is what the stages before it wait out at the end: a stage of
    the default model at 2 ranks took 254-271 ms for the first of 8 pieces of a
    1,440-token prompt and 717-738 for the last (both stages at once); by these times the
    forward took 4,502 ms and measured 4,472, where equal pieces gave 4,305."""
    ends = [0.0] * len(stage_piece_ms[0]) if stage_piece_ms else []
    for pieces in stage_piece_ms:
        end = 0.0
        for k, ms in enumerate(pieces):
            end = max(end, ends[k]) + ms
            ends[k] = end
    return ends[-1] if ends else 0.0
