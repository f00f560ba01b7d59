"""A prompt prefilling on every rank, and which waiting prompts share one batched forward.

The batch engine (engine/batch_engine.py) keeps a Prefill per sequence until its prompt is
in its KV cache; a burst of short prompts that arrive together prefills in one forward,
left-padded into one batch cache (`fresh_group` picks them).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx

# A prompt's last chunk longer than this fills the cache with all but its last token, then
# runs that token alone for the logits: MLX computes only what is read, so the last layer's
# attention and MLP for the chunk's other rows are never computed (as in mlx-lm's own
# prefill). A long agent prompt's first token came several times later than mlx_lm.server's
# when its whole last chunk went through one forward (docs/BENCHMARKS.md, "Figures behind
# the code").
LAST_TOKEN_ALONE = 32


@dataclass(eq=False)
class Prefill:
    """A sequence still prefilling: `tokens` after its cached prefix, `position` of them
    done; `store_as` a prefix entry to keep its prompt's KV in once prefilled (0: none)."""

    seq_id: int
    tokens: list[int]
    prefix_len: int = 0
    store_as: int = 0
    position: int = 0
    cache: list = field(default_factory=list)

    @property
    def length(self) -> int:
        """Positions in its cache."""
        return self.prefix_len + self.position


def fresh_group(prefilling: list[Prefill], chunk_size: int, budget: int | None) -> list[Prefill]:
    """Leading unstarted short prompts (at most one chunk each) that fit `budget`
    together (None: no limit on their total). Whole prompts are left-padded to the
    group's width; one that starts from a cached prefix is not padded, so it joins
    only at the group's width (rank 0 aligns bursts so: leader/prefix_cache.py)."""
    group: list[Prefill] = []
    width = 0
    for entry in prefilling:
        if entry.position or len(entry.tokens) > chunk_size:
            break
        wider = max(width, len(entry.tokens))
        if budget is not None and (len(group) + 1) * wider > budget:
            break
        if any(e.prefix_len and len(e.tokens) != wider for e in [*group, entry]):
            break
        group.append(entry)
        width = wider
    return group


# A prompt the step finished: its entries (one, or a batched group), the logits of their last
# positions, and their batch cache (a group's) or None.
Finished = tuple[list[Prefill], mx.array, list | None]
