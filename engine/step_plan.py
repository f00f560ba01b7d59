"""The step plan rank 0 broadcasts before every step: a compact, versioned binary form.

Layout (little endian): header `<BBQQHHH` = version, flags, step, fingerprint,
len(removes), len(tokens), len(inserts); then removes and tokens as uint32 arrays; then
each insert as `<III` (seq id, prefix length, token count) followed by its uint32 tokens.
`fingerprint` describes the batch every rank must hold *before* applying the plan.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass, field

PLAN_VERSION = 1
FLAG_STOP = 1
FLAG_SLEEP = 2

_HEADER = struct.Struct("<BBQQHHH")
_INSERT = struct.Struct("<III")


class PlanDecodeError(Exception):
    """The bytes are not a step plan this version understands."""


@dataclass
class Insert:
    """A new sequence: its prompt tokens (prefix_len of them already cached, for later)."""

    seq_id: int
    tokens: list[int]
    prefix_len: int = 0


@dataclass
class StepPlan:
    """What every rank does in one step.

    removes: sequences to drop (finished, cancelled, disconnected).
    tokens: the next input token of each decoding sequence, in batch order after removes.
    inserts: sequences to start prefilling.
    """

    step: int
    fingerprint: int
    removes: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    inserts: list[Insert] = field(default_factory=list)
    stop: bool = False
    sleep: bool = False

    def encode(self) -> bytes:
        """Serialize to bytes (no pickle)."""
        flags = (FLAG_STOP if self.stop else 0) | (FLAG_SLEEP if self.sleep else 0)
        parts = [
            _HEADER.pack(
                PLAN_VERSION,
                flags,
                self.step,
                self.fingerprint,
                len(self.removes),
                len(self.tokens),
                len(self.inserts),
            ),
            struct.pack(f"<{len(self.removes)}I", *self.removes),
            struct.pack(f"<{len(self.tokens)}I", *self.tokens),
        ]
        for insert in self.inserts:
            parts.append(_INSERT.pack(insert.seq_id, insert.prefix_len, len(insert.tokens)))
            parts.append(struct.pack(f"<{len(insert.tokens)}I", *insert.tokens))
        return b"".join(parts)

    @classmethod
    def decode(cls, data: bytes) -> StepPlan:
        """Parse bytes made by `encode`; PlanDecodeError on anything else."""
        try:
            version, flags, step, fingerprint, n_rm, n_tok, n_ins = _HEADER.unpack_from(data)
            if version != PLAN_VERSION:
                raise PlanDecodeError(
                    f"step plan version {version}, this rank understands {PLAN_VERSION}"
                )
            offset = _HEADER.size
            removes = list(struct.unpack_from(f"<{n_rm}I", data, offset))
            offset += 4 * n_rm
            tokens = list(struct.unpack_from(f"<{n_tok}I", data, offset))
            offset += 4 * n_tok
            inserts = []
            for _ in range(n_ins):
                seq_id, prefix_len, count = _INSERT.unpack_from(data, offset)
                offset += _INSERT.size
                ids = list(struct.unpack_from(f"<{count}I", data, offset))
                offset += 4 * count
                inserts.append(Insert(seq_id, ids, prefix_len))
        except struct.error as exc:
            raise PlanDecodeError(f"truncated or malformed step plan: {exc}") from None
        if offset != len(data):
            raise PlanDecodeError(f"step plan has {len(data) - offset} trailing bytes")
        return cls(
            step=step,
            fingerprint=fingerprint,
            removes=removes,
            tokens=tokens,
            inserts=inserts,
            stop=bool(flags & FLAG_STOP),
            sleep=bool(flags & FLAG_SLEEP),
        )


def batch_fingerprint(step: int, entries: list[tuple[int, int, int]]) -> int:
    """64-bit digest of the step number and (seq id, phase, length) of every sequence."""
    packed = struct.pack("<Q", step) + b"".join(struct.pack("<IBI", *e) for e in entries)
    return int.from_bytes(hashlib.blake2b(packed, digest_size=8).digest(), "little")
