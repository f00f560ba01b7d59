"""Rank 0's index of the prefix cache: which token sequences every rank holds KV for.

A radix tree over token ids: each cached entry is a path from the root, and a query walks
its prompt down the tree as far as the tokens agree (token-level, so a chat template that
re-renders earlier turns still matches up to the first differing token). Entries are
immutable; the index decides every store and eviction (least recently used first, within
a budget in tokens) and the step plan carries those decisions to every rank.

Entries are `pending` from the step that stores them until rank 0 sees that step's result;
a query reports the longest ready match and, apart, the longest pending one, so the
scheduler can wait for a prefix another request is about to store instead of computing it
a second time.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field


@dataclass(eq=False)
class _Node:
    """A tree node: the edge from its parent is `label`; `entries` end exactly here."""

    label: tuple[int, ...] = ()
    parent: _Node | None = None
    children: dict[int, _Node] = field(default_factory=dict)
    entries: set[int] = field(default_factory=set)

    def any_entry(self, usable: dict[int, bool]) -> int | None:
        """An entry at or below this node that `usable` allows (any path through the node
        holds the node's tokens, so any such entry can serve them)."""
        for entry in self.entries:
            if usable.get(entry):
                return entry
        for child in self.children.values():
            found = child.any_entry(usable)
            if found is not None:
                return found
        return None


@dataclass(frozen=True)
class Match:
    """The best cached prefix of a query: `length` tokens of `entry` (0 / None: no hit),
    and how far a pending entry would reach."""

    entry: int | None
    length: int
    pending_length: int = 0


@dataclass
class Entry:
    tokens: tuple[int, ...]
    ready: bool
    last_used: int


@dataclass
class Reservation:
    """A store the index accepted: the new entry's id and the entries to evict first."""

    entry: int
    evicts: list[int]


class PrefixIndex:
    """Token radix tree of the cached entries, with LRU eviction within `budget_tokens`."""

    def __init__(self, budget_tokens: int, min_tokens: int = 16) -> None:
        self.budget_tokens = budget_tokens
        self.min_tokens = min_tokens  # shorter sequences are not worth an entry
        self.root = _Node()
        self.entries: dict[int, Entry] = {}
        self._ids = itertools.count(1)
        self._clock = itertools.count(1)
        self.evictions = 0

    @property
    def enabled(self) -> bool:
        return self.budget_tokens >= self.min_tokens

    @property
    def cached_tokens(self) -> int:
        return sum(len(entry.tokens) for entry in self.entries.values())

    # ---- queries -----------------------------------------------------------------

    def match(self, tokens: list[int]) -> Match:
        """The longest ready prefix of `tokens` held by an entry, and the longest pending."""
        ready = {e: entry.ready for e, entry in self.entries.items()}
        pending = {e: not entry.ready for e, entry in self.entries.items()}
        best: tuple[int | None, int] = (None, 0)
        best_pending = 0
        for node, depth in self._walk(tokens):
            entry = node.any_entry(ready)
            if entry is not None:
                best = (entry, depth)
            if node.any_entry(pending) is not None:
                best_pending = depth
        return Match(best[0], best[1], best_pending)

    def _walk(self, tokens: list[int]) -> Iterator[tuple[_Node, int]]:
        """Each node the query passes into (with the depth reached inside it)."""
        node, depth = self.root, 0
        while depth < len(tokens):
            child = node.children.get(tokens[depth])
            if child is None:
                return
            agree = _common_length(child.label, tokens, depth)
            yield child, depth + agree
            if agree < len(child.label):
                return
            node, depth = child, depth + agree

    def use(self, entry: int) -> None:
        """Mark `entry` as just used (LRU)."""
        self.entries[entry].last_used = next(self._clock)

    # ---- stores and evictions ----------------------------------------------------

    def reserve(
        self, tokens: list[int], ready: bool = False, protected: set[int] | None = None
    ) -> Reservation | None:
        """Accept `tokens` as a new entry, evicting what it supersedes and then the least
        recently used until it fits; None (and nothing evicted) when it is too short,
        already held, or cannot fit. `protected` entries and pending ones (their KV is not
        stored yet) are never evicted."""
        if len(tokens) < self.min_tokens or len(tokens) > self.budget_tokens:
            return None
        if self._holds(tokens):
            return None
        keep = set(protected or ()) | {e for e, entry in self.entries.items() if not entry.ready}
        # entries the new one extends are redundant: replaced, not counted as evictions
        replaced = [
            e
            for e, entry in self.entries.items()
            if e not in keep and _is_prefix(entry.tokens, tokens)
        ]
        used = self.cached_tokens - sum(len(self.entries[e].tokens) for e in replaced)
        evicted: list[int] = []
        for entry_id, entry in sorted(self.entries.items(), key=lambda item: item[1].last_used):
            if used + len(tokens) <= self.budget_tokens:
                break
            if entry_id not in replaced and entry_id not in keep:
                evicted.append(entry_id)
                used -= len(entry.tokens)
        if used + len(tokens) > self.budget_tokens:
            return None
        evicts = replaced + evicted
        for entry_id in evicts:
            self._remove(entry_id)
        self.evictions += len(evicted)
        entry_id = next(self._ids)
        self.entries[entry_id] = Entry(tuple(tokens), ready, next(self._clock))
        self._insert(entry_id, tuple(tokens))
        return Reservation(entry_id, evicts)

    def mark_ready(self, entry: int) -> None:
        if entry in self.entries:
            self.entries[entry].ready = True

    def forget(self, entry: int) -> None:
        """Drop a pending entry whose KV the ranks never stored (not an eviction)."""
        if entry in self.entries and not self.entries[entry].ready:
            self._remove(entry)

    def _holds(self, tokens: list[int]) -> bool:
        """An entry already covers all of `tokens` (equal, or longer with them as prefix)."""
        return any(_is_prefix(tokens, entry.tokens) for entry in self.entries.values())

    def _insert(self, entry_id: int, tokens: tuple[int, ...]) -> None:
        node, depth = self.root, 0
        while depth < len(tokens):
            child = node.children.get(tokens[depth])
            if child is None:
                leaf = _Node(label=tokens[depth:], parent=node)
                node.children[tokens[depth]] = leaf
                node, depth = leaf, len(tokens)
                break
            agree = _common_length(child.label, list(tokens), depth)
            if agree < len(child.label):
                child = _split(child, agree)
            node, depth = child, depth + agree
        node.entries.add(entry_id)

    def _remove(self, entry_id: int) -> None:
        entry = self.entries.pop(entry_id)
        node = self.root
        depth = 0
        while depth < len(entry.tokens):
            node = node.children[entry.tokens[depth]]
            depth += len(node.label)
        node.entries.discard(entry_id)
        while node is not self.root and not node.entries and not node.children:
            parent = node.parent
            assert parent is not None
            del parent.children[node.label[0]]
            node = parent


def shared_prefix(first: list[int], second: list[int]) -> int:
    """How many tokens two sequences share from their start."""
    pairs = zip(first, second, strict=False)
    return next((i for i, (a, b) in enumerate(pairs) if a != b), min(len(first), len(second)))


def _common_length(label: tuple[int, ...], tokens: list[int], start: int) -> int:
    count = 0
    for a, b in zip(label, itertools.islice(tokens, start, None), strict=False):
        if a != b:
            break
        count += 1
    return count


def _is_prefix(short: tuple[int, ...] | list[int], long: tuple[int, ...] | list[int]) -> bool:
    return len(short) <= len(long) and tuple(long[: len(short)]) == tuple(short)


def _split(node: _Node, at: int) -> _Node:
    """Cut `node`'s edge after `at` tokens; returns the new middle node."""
    parent = node.parent
    assert parent is not None
    middle = _Node(label=node.label[:at], parent=parent)
    parent.children[middle.label[0]] = middle
    node.label = node.label[at:]
    node.parent = middle
    middle.children[node.label[0]] = node
    return middle
