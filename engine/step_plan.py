"""The one interface between rank 0's request side (leader/) and the compute every rank
runs in lock-step (engine/): a StepPlan in, a StepResult out.

Each step rank 0 builds a StepPlan from its requests (leader/scheduler.py) and broadcasts
its bytes; every rank decodes it, checks it against its own batch (the fingerprint) and
applies it (engine/batch_engine.py `apply`, which answers with the plan's disk loads as
the ranks voted), then runs the step's forward. On rank 0 the engine also samples, with
the `Sampling` rank 0 passes in (how to sample each row), and answers with a StepResult:
every row's logits and sampled tokens, the prefill it did and what rank 0's rules measure
(its prefill forwards, whether the decode ran eagerly, the prefix cache's bytes). Between
steps rank 0 plans against its own engine's batch (decode ids, prefilling sequences, the
step index and fingerprint), which every rank holds alike. Nothing else crosses: engine/
imports neither ipc/ nor leader/ (tests/test_house.py).

The plan's wire form: compact, versioned binary, never pickle. Layout (little endian):
header `<BBQQHHHHH` = version, flags, step, fingerprint, len(removes), len(tokens),
len(inserts), len(stores), len(evicts); then removes and tokens as uint32 arrays; each
insert as `<IIIII` (seq id, prefix entry, prefix length, store-as entry, token count)
followed by its uint32 tokens; each store as `<III` (seq id, entry, length); evicts as a
uint32 array; with FLAG_ROLLBACKS, a uint16 count and the rollbacks as a uint16 array; with
FLAG_DRAFTS, one uint8 count per next token, then all the drafts' tokens as one uint32
array; with FLAG_PREFILL, the prefill budget as a uint32; with FLAG_DISK, `<HHH` counts of
saves, loads and drops, then saves as `<IQ` (entry, disk key), loads as `<IQI` (entry,
disk key, length) and drops as uint64 keys. A plan of a step that neither speculates,
prefills nor touches the disk is as long as in version 2. `fingerprint` describes the
batch and the prefix entries every rank must hold *before* applying the plan. Every rank
applies a plan in one order: rollbacks, evicts, stores, disk saves, loads and drops,
removes, next tokens (with their drafts), inserts.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import mlx.core as mx

    from engine.batch_sampler import RowSampling, Sampled

# 3: speculative steps (drafts and rollbacks); 4: the prefill budget; 5: the disk tier
PLAN_VERSION = 5
FLAG_STOP = 1
FLAG_SLEEP = 2
FLAG_DRAFTS = 4
FLAG_ROLLBACKS = 8
FLAG_PREFILL = 16
FLAG_DISK = 32
MAX_DRAFT = 255  # tokens proposed for one row (a uint8 count)

_HEADER = struct.Struct("<BBQQHHHHH")
_INSERT = struct.Struct("<IIIII")
_STORE = struct.Struct("<III")
_DISK_COUNTS = struct.Struct("<HHH")
_SAVE = struct.Struct("<IQ")
_LOAD = struct.Struct("<IQI")


class PlanDecodeError(Exception):
    """The bytes are not a step plan this version understands."""


class _Reader:
    """A plan's bytes, read front to back."""

    def __init__(self, data: bytes) -> None:
        self.data, self.offset = data, 0

    def unpack(self, layout: struct.Struct) -> tuple[Any, ...]:
        values = layout.unpack_from(self.data, self.offset)
        self.offset += layout.size
        return values

    def array(self, count: int, code: str = "I") -> list[int]:
        """`count` little-endian integers of struct type `code` (uint32 by default); by
        format string, which struct compiles once and caches (this runs every step)."""
        layout = f"<{count}{code}"
        values = struct.unpack_from(layout, self.data, self.offset)
        self.offset += struct.calcsize(layout)
        return list(values)


@dataclass
class Insert:
    """A new sequence. It starts from the first `prefix_len` positions of prefix entry
    `prefix_entry` (0: none) and prefills `tokens`, the rest of its prompt; with
    `store_as` (0: none) every rank keeps its prompt's KV as that entry once prefilled."""

    seq_id: int
    tokens: list[int]
    prefix_entry: int = 0
    prefix_len: int = 0
    store_as: int = 0


@dataclass
class Store:
    """Keep the first `length` cached positions of sequence `seq_id` as `entry`: a decoding
    one, or one still prefilling (a prompt cancelled mid-prefill keeps its chunks)."""

    seq_id: int
    entry: int
    length: int


@dataclass
class StepPlan:
    """What every rank does in one step.

    removes: sequences to drop (finished, cancelled, disconnected).
    tokens: the next input token of each decoding sequence, in batch order after removes.
    inserts: sequences to start prefilling.
    stores: sequences whose KV becomes a prefix entry (before their removal).
    evicts: prefix entries every rank drops.
    drafts: per next token (empty, or as many lists as `tokens`), the tokens rank 0 proposes
        after it: the row's forward takes them as further positions (leader/speculation.py).
    rollbacks: per decoding sequence as held before this plan (empty: none), how many of the
        positions the previous step wrote it drops: the proposals rank 0 did not accept.
    prefill: the most prompt tokens the step prefills, over all prefilling sequences
        (leader/prefill_budget.py; 0: none, the step only decodes; None: the engine's
        PREFILL_CHUNK_SIZE).
    saves, loads, drops: the prefix cache's disk tier (engine/prefix_disk.py): save entry
        as key; load key's first `length` positions into entry; delete key.
    """

    step: int
    fingerprint: int
    removes: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    inserts: list[Insert] = field(default_factory=list)
    stores: list[Store] = field(default_factory=list)
    evicts: list[int] = field(default_factory=list)
    drafts: list[list[int]] = field(default_factory=list)
    rollbacks: list[int] = field(default_factory=list)
    prefill: int | None = None
    saves: list[tuple[int, int]] = field(default_factory=list)
    loads: list[tuple[int, int, int]] = field(default_factory=list)
    drops: list[int] = field(default_factory=list)
    stop: bool = False
    sleep: bool = False

    def encode(self) -> bytes:
        """Serialize to bytes (no pickle)."""
        flags = (FLAG_STOP if self.stop else 0) | (FLAG_SLEEP if self.sleep else 0)
        drafted = any(self.drafts)
        flags |= FLAG_ROLLBACKS if self.rollbacks else 0
        flags |= FLAG_PREFILL if self.prefill is not None else 0
        disk = bool(self.saves or self.loads or self.drops)
        flags |= FLAG_DISK if disk else 0
        if drafted:
            flags |= FLAG_DRAFTS
            if len(self.drafts) != len(self.tokens):
                raise ValueError(
                    f"{len(self.drafts)} drafts for {len(self.tokens)} next tokens: one each"
                )
            if max(len(d) for d in self.drafts) > MAX_DRAFT:
                raise ValueError(f"a row's draft holds at most {MAX_DRAFT} tokens")
        parts = [
            _HEADER.pack(
                PLAN_VERSION,
                flags,
                self.step,
                self.fingerprint,
                len(self.removes),
                len(self.tokens),
                len(self.inserts),
                len(self.stores),
                len(self.evicts),
            ),
            struct.pack(f"<{len(self.removes)}I", *self.removes),
            struct.pack(f"<{len(self.tokens)}I", *self.tokens),
        ]
        for i in self.inserts:
            parts.append(
                _INSERT.pack(i.seq_id, i.prefix_entry, i.prefix_len, i.store_as, len(i.tokens))
            )
            parts.append(struct.pack(f"<{len(i.tokens)}I", *i.tokens))
        parts += [_STORE.pack(s.seq_id, s.entry, s.length) for s in self.stores]
        parts.append(struct.pack(f"<{len(self.evicts)}I", *self.evicts))
        if self.rollbacks:
            parts.append(
                struct.pack(f"<H{len(self.rollbacks)}H", len(self.rollbacks), *self.rollbacks)
            )
        if drafted:
            parts.append(bytes(len(d) for d in self.drafts))
            flat = [t for d in self.drafts for t in d]
            parts.append(struct.pack(f"<{len(flat)}I", *flat))
        if self.prefill is not None:
            parts.append(struct.pack("<I", self.prefill))
        if disk:
            parts.append(_DISK_COUNTS.pack(len(self.saves), len(self.loads), len(self.drops)))
            parts += [_SAVE.pack(*save) for save in self.saves]
            parts += [_LOAD.pack(*load) for load in self.loads]
            parts.append(struct.pack(f"<{len(self.drops)}Q", *self.drops))
        return b"".join(parts)

    @classmethod
    def decode(cls, data: bytes) -> StepPlan:
        """Parse bytes made by `encode`; PlanDecodeError on anything else."""
        read = _Reader(data)
        try:
            version, flags, step, fingerprint, n_rm, n_tok, n_ins, n_st, n_ev = read.unpack(_HEADER)
            if version != PLAN_VERSION:
                raise PlanDecodeError(
                    f"step plan version {version}, this rank understands {PLAN_VERSION}"
                )
            plan = cls(
                step, fingerprint, stop=bool(flags & FLAG_STOP), sleep=bool(flags & FLAG_SLEEP)
            )
            plan.removes = read.array(n_rm)
            plan.tokens = read.array(n_tok)
            for _ in range(n_ins):
                seq_id, prefix_entry, prefix_len, store_as, count = read.unpack(_INSERT)
                insert = Insert(seq_id, read.array(count), prefix_entry, prefix_len, store_as)
                plan.inserts.append(insert)
            plan.stores = [Store(*read.unpack(_STORE)) for _ in range(n_st)]
            plan.evicts = read.array(n_ev)
            if flags & FLAG_ROLLBACKS:
                plan.rollbacks = read.array(read.array(1, "H")[0], "H")
            if flags & FLAG_DRAFTS:
                plan.drafts = [read.array(count) for count in read.array(n_tok, "B")]
            if flags & FLAG_PREFILL:
                plan.prefill = read.array(1)[0]
            if flags & FLAG_DISK:
                n_sv, n_ld, n_dr = read.unpack(_DISK_COUNTS)
                plan.saves = [read.unpack(_SAVE) for _ in range(n_sv)]
                plan.loads = [read.unpack(_LOAD) for _ in range(n_ld)]
                plan.drops = read.array(n_dr, "Q")
        except struct.error as exc:
            raise PlanDecodeError(f"truncated or malformed step plan: {exc}") from None
        if read.offset != len(data):
            raise PlanDecodeError(f"step plan has {len(data) - read.offset} trailing bytes")
        return plan


# Rank 0's sampling of a step: how to sample each row, given the sequence ids and how many
# positions each has in the step's logits (more than one in a speculative step).
Sampling = Callable[[list[int], list[int]], Sequence["RowSampling"]]


@dataclass
class StepResult:
    """Every sequence that produced a next-token distribution this step: its logits, and
    on rank 0 (which samples inside the step) its sampled token. `seq_ids[i]` owns
    `widths[i]` consecutive rows (1, or a speculative step's positions): first the decode
    batch, then sequences whose prompt finished prefilling this step (they join the decode
    batch in that order). `prefill_forwards`: the step's prefill forwards as (cached
    positions, tokens); `eager`: its decode forward was not compiled; `prefix_bytes`: this
    rank's prefix-cache entries after it."""

    seq_ids: list[int]
    logits: mx.array | None
    prefill_tokens: int = 0
    sampled: Sampled | None = None
    widths: list[int] = field(default_factory=list)
    prefill_forwards: list[tuple[int, int]] = field(default_factory=list)
    eager: bool = True
    prefix_bytes: int = 0


def batch_fingerprint(
    step: int, entries: list[tuple[int, int, int]], prefix: Sequence[tuple[int, int]] = ()
) -> int:
    """64-bit digest of the step number, (seq id, phase, length) of every sequence, and
    (entry, length) of every prefix-cache entry held."""
    packed = struct.pack("<Q", step) + b"".join(struct.pack("<IBI", *e) for e in entries)
    packed += b"".join(struct.pack("<II", *item) for item in prefix)
    return int.from_bytes(hashlib.blake2b(packed, digest_size=8).digest(), "little")


def step_width(drafts: Sequence[Sequence[int]]) -> int:
    """Positions each decoding row takes in a step: its next token and the longest draft
    (1 without speculation; rows with shorter drafts are padded to it)."""
    return 1 + max((len(draft) for draft in drafts), default=0)
