"""Prompt lookup: a row's proposals are the continuation of an earlier place in its own
history (the whole conversation as rendered, tool results included, then its answer so
far) that its latest tokens repeat. Edits and tool arguments copy text the conversation
holds: a file read earlier, the old string of an Edit call, a patch's context lines.

A match, once found, is followed: while the row's new tokens keep equal to the tokens after
the matched place, the next proposal continues from there, and `run` counts how long it
has held. Only when the row leaves it is a place searched anew: the latest earlier
occurrence of its last n tokens, n from NGRAM_MAX down to NGRAM_MIN. Searching anew at
every step instead jumped to the latest repeat of short, common n-grams (a line's
indentation and `return`), away from the copy the answer was following.

The history is an int32 array searched with numpy when needed: a dictionary of every
n-gram was slow to build for a long prompt and took much memory a row (docs/BENCHMARKS.md,
"Figures behind the code").
"""

from __future__ import annotations

import numpy as np

NGRAM_MAX = 6  # the longest suffix searched; a longer one tells places apart better
NGRAM_MIN = 2  # shorter suffixes propose too often to pay (one token matches anywhere)


class PromptLookup:
    """One row's history and the match it follows."""

    def __init__(self) -> None:
        self._tokens = np.zeros(1024, dtype=np.int64)
        self.size = 0
        self.cursor: int | None = None  # the followed match's next token, in the history
        self.run = 0  # tokens the followed match has held for (its n-gram included)

    def __len__(self) -> int:
        return self.size

    @property
    def tokens(self) -> list[int]:
        return self._tokens[: self.size].tolist()

    def extend(self, tokens: list[int]) -> None:
        """Append the row's new tokens; the followed match moves on while they agree. They
        are stored first: a match whose continuation reaches the row's latest tokens (an
        answer repeating itself) moves into the tokens this call appends when a step
        accepted several (before, it read past the history: a stale 0, or an IndexError
        that stopped rank 0 when the history filled its array)."""
        start, end = self.size, self.size + len(tokens)
        if end > len(self._tokens):
            grown = np.zeros(max(end, 2 * len(self._tokens)), dtype=np.int64)
            grown[:start] = self._tokens[:start]
            self._tokens = grown
        self._tokens[start:end] = tokens
        self.size = end
        for token in tokens:
            if self.cursor is None:
                break
            if self._tokens[self.cursor] == token:
                self.cursor += 1
                self.run += 1
            else:
                self.cursor, self.run = None, 0

    def propose(self, limit: int) -> list[int]:
        """Up to `limit` tokens: the followed match's continuation, else the continuation
        of the longest suffix that occurred before (which is followed from then on)."""
        if limit <= 0:
            return []
        if self.cursor is None:
            self._search()
        if self.cursor is None:
            return []
        return self._tokens[self.cursor : min(self.cursor + limit, self.size)].tolist()

    def _search(self) -> None:
        """The latest earlier occurrence of the longest suffix (NGRAM_MAX .. NGRAM_MIN)."""
        history = self._tokens[: self.size]
        if self.size <= NGRAM_MIN:
            return
        # ends of earlier occurrences of the last token (its own place excluded)
        ends = np.flatnonzero(history[:-1] == history[-1])
        best, length = None, 0
        for back in range(1, min(NGRAM_MAX, self.size - 1)):
            ends = ends[ends >= back]
            ends = ends[history[ends - back] == history[-1 - back]]
            if not len(ends):
                break
            if back + 1 >= NGRAM_MIN:
                best, length = int(ends[-1]), back + 1
        if best is not None:
            self.cursor, self.run = best + 1, length
