"""Rank 0's prefix-cache policy: what a new request reuses, when it waits for a prefix
another request is about to store, what is stored, and the counters /metrics shows.

The PrefixIndex holds the token sequences; this class turns its answers into the step
plan's cache operations (an insert's prefix entry and `store_as`, stores of finished
sequences, evictions), which every rank applies in lock-step. With the disk tier
(PREFIX_CACHE_DIR, engine/prefix_disk.py) every stored conversation is also saved, and a
request whose prompt starts with a saved one that memory no longer holds (evicted, or
lost in a restart) waits one step while the ranks load it into a memory entry.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from engine.prefix_disk import token_key
from engine.step_plan import Insert, StepPlan, Store
from ipc.status import PrefixCacheStats
from leader.prefix_disk_index import DiskIndex
from leader.prefix_index import PrefixIndex

log = logging.getLogger("ring.prefix")
# A queued request waits for a prefix that a prefilling request is about to store when
# that saves it at least this many prompt tokens (else it prefills them itself).
HOLD_FOR_TOKENS = 64
# Short prompts admitted together prefill in one batched forward only where their rests
# have one width (engine/batch_engine.py). On the CPU, short prompts after a cached prefix
# took less time a token batched than one by one, with OpenBLAS's SSE3 kernels and more so
# with its AVX-512 ones (docs/BENCHMARKS.md, "Figures behind the code"). So a burst
# recomputes cached tokens to reach one width where that adds at most a quarter to its tokens.
BURST_EXTRA = 1.25


@dataclass
class PlanOps:
    """The cache operations one step plan carries."""

    stores: list[Store] = field(default_factory=list)
    evicts: list[int] = field(default_factory=list)
    protected: set[int] = field(default_factory=set)  # entries this plan's inserts reuse
    saves: list[tuple[int, int]] = field(default_factory=list)  # (entry, disk key)
    loads: list[tuple[int, int, int]] = field(default_factory=list)  # (entry, key, length)
    drops: list[int] = field(default_factory=list)  # disk keys

    def carried_by(self, plan: StepPlan) -> StepPlan:
        """`plan` with these operations (it carries all but `protected`)."""
        plan.stores, plan.evicts = self.stores, self.evicts
        plan.saves, plan.loads, plan.drops = self.saves, self.loads, self.drops
        return plan


class PrefixCache:
    """Decisions over the index; `budget_tokens` 0 turns the cache off."""

    def __init__(
        self, budget_tokens: int, min_tokens: int = 16, disk: DiskIndex | None = None
    ) -> None:
        self.index = PrefixIndex(budget_tokens, min_tokens)
        self.disk = disk if self.index.enabled else None
        self._drops: list[int] = []  # disk keys a failed load left on the other ranks
        self.hits = 0
        self.hit_tokens = 0
        self.misses = 0
        self.bytes = 0  # rank 0's own bytes (set by the leader after each step)
        self._finished: list[tuple[int, list[int]]] = []  # (seq id, cached tokens)
        # requests cancelled while their prompt prefilled: (seq id, prompt)
        self._cancelled: list[tuple[int, list[int]]] = []
        self._prompt_entries: dict[int, int] = {}  # seq id -> its pending prompt entry

    @property
    def enabled(self) -> bool:
        return self.index.enabled

    def admit(self, seq_id: int, prompt: list[int], ops: PlanOps) -> Insert | None:
        """The insert for a new request, or None when it should wait for a pending prefix."""
        if not self.enabled:
            return Insert(seq_id, prompt)
        match = self.index.match(prompt)
        if match.pending_length >= match.length + HOLD_FOR_TOKENS:
            return None
        if self.disk is not None and self._load(prompt, match.length, ops):
            return None  # the ranks load its prefix this step
        # The last prompt token always runs through the model: its logits start the answer.
        reused = min(match.length, len(prompt) - 1) if match.entry is not None else 0
        entry = match.entry if reused > 0 else None
        if entry is not None:
            self.index.use(entry)
            ops.protected.add(entry)
            self.hits += 1
            self.hit_tokens += reused
        else:
            self.misses += 1
        insert = Insert(seq_id, prompt[reused:], entry or 0, reused)
        reservation = self.index.reserve(prompt, ready=False, protected=ops.protected)
        if reservation is not None:
            insert.store_as = reservation.entry
            ops.evicts += reservation.evicts
            self._prompt_entries[seq_id] = reservation.entry
        return insert

    def _load(self, prompt: list[int], in_memory: int, ops: PlanOps) -> bool:
        """Plan the load of the saved entry sharing the longest start with `prompt`, where
        it reaches HOLD_FOR_TOKENS further than memory does and an entry can hold it."""
        assert self.disk is not None
        key, length = self.disk.match(prompt)
        length = min(length, len(prompt) - 1)
        if not key or length < in_memory + HOLD_FOR_TOKENS:
            return False
        reservation = self.index.reserve(prompt[:length], ready=False, protected=ops.protected)
        if reservation is None:
            return False
        ops.loads.append((reservation.entry, key, length))
        ops.evicts += reservation.evicts
        ops.protected.add(reservation.entry)
        self.disk.loading.add(key)
        return True

    def loaded(self, results: list[tuple[int, int, bool]]) -> None:
        """The last plan's loads, as the ranks voted: a loaded entry is ready; a failed one
        is forgotten here and on disk (the ranks compute those tokens)."""
        if self.disk is None:
            return
        for entry, key, ok in results:
            self.disk.loaded(key, ok)
            if ok:
                self.index.mark_ready(entry)
            else:
                self.index.forget(entry)
                self._drops.append(key)

    def align_burst(self, inserts: list[Insert], prompts: list[list[int]], chunk: int) -> None:
        """Give the leading inserts of a plan whose rests fit one `chunk` one width: each
        reuses its cached prefix up to its prompt's last `width` tokens (a shorter prompt
        prefills whole), `width` being the longest rest among them; only where that
        prefills at most BURST_EXTRA times the tokens of the rests alone."""
        burst = []
        for insert in inserts:
            if len(insert.tokens) > chunk:
                break
            burst.append(insert)
        if len(burst) < 2 or not any(insert.prefix_len for insert in burst):
            return
        width = max(len(insert.tokens) for insert in burst)
        if width * len(burst) > BURST_EXTRA * sum(len(insert.tokens) for insert in burst):
            return
        for insert, prompt in zip(burst, prompts, strict=False):
            reused = max(0, len(prompt) - width)
            self.hit_tokens -= insert.prefix_len - reused
            insert.tokens = prompt[reused:]
            insert.prefix_len = reused
            if not reused and insert.prefix_entry:
                insert.prefix_entry = 0
                self.hits -= 1
                self.misses += 1

    def prefilled(self, seq_id: int) -> None:
        """The sequence's prompt is in every rank's cache now (its first token came back)."""
        entry = self._prompt_entries.pop(seq_id, None)
        if entry is not None:
            self.index.mark_ready(entry)

    def finished(self, seq_id: int, tokens: list[int], completed: bool) -> None:
        """A request ended. A completed one has `tokens` (prompt and answer, less the last
        token) in the decode batch: keep them. A prompt entry still pending was never
        stored by the ranks, since the request left before its prefill ended: forget it;
        what its prompt (`tokens` of a request that did not complete) prefilled so far is
        kept instead (`plan_stores`), so a client that cancels and asks again (an agent
        interrupted mid-prefill) does not pay for those tokens twice."""
        entry = self._prompt_entries.pop(seq_id, None)
        if entry is not None:
            self.index.forget(entry)
        if not self.enabled:
            return
        if completed:
            self._finished.append((seq_id, tokens))
        elif entry is not None and tokens:
            self._cancelled.append((seq_id, tokens))

    def plan_stores(self, ops: PlanOps, prefilled: dict[int, int]) -> None:
        """Stores (and the evictions they need) for the requests that finished last step,
        and for those cancelled while prefilling, the positions every rank holds of them
        (`prefilled`: seq id -> positions, of the sequences still prefilling)."""
        finished, self._finished = self._finished, []
        cancelled, self._cancelled = self._cancelled, []
        finished += [(s, prompt[: prefilled.get(s, 0)]) for s, prompt in cancelled]
        ops.drops += self._drops
        self._drops = []
        for seq_id, tokens in finished:
            reservation = self.index.reserve(tokens, ready=True, protected=ops.protected)
            if reservation is not None:
                ops.stores.append(Store(seq_id, reservation.entry, len(tokens)))
                ops.evicts += reservation.evicts
                ops.protected.add(reservation.entry)  # evicts apply before stores
                if self.disk is not None:
                    key = token_key(tokens)
                    if key not in self.disk.entries:
                        ops.saves.append((reservation.entry, key))
                        ops.drops += self.disk.record(key, tokens, set())

    def stats(self) -> PrefixCacheStats:
        disk = self.disk
        return PrefixCacheStats(
            disk_entries=len(disk.entries) if disk else 0,
            disk_tokens=disk.tokens if disk else 0,
            disk_loads=disk.loads if disk else 0,
            disk_load_failures=disk.load_failures if disk else 0,
            enabled=self.enabled,
            budget_tokens=self.index.budget_tokens,
            entries=len(self.index.entries),
            cached_tokens=self.index.cached_tokens,
            bytes=self.bytes,
            hits=self.hits,
            hit_tokens=self.hit_tokens,
            misses=self.misses,
            evictions=self.index.evictions,
        )
