"""Per-rank batch state: applies a step plan and runs the forward passes of one step.

Every rank holds the same state in the same order. New sequences prefill alone with their
own KV cache, in chunks of the plan's budget (leader/prefill_budget.py), so a long prompt
never stalls the running batch for long; a prompt done joins the decode batch (a BatchKVCache
per layer; engine/quantized_kv.py with KV_CACHE_BITS). A sequence may start from a prefix
entry (engine/prefix_store.py, on disk prefix_disk.py). A speculative step (speculation.py)
gives decoding rows rank 0's proposals: one forward over them all, right-padded; the next
plan says how many positions each drops."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import mlx.core as mx

from distributed.head_positions import computing
from distributed.watchdog import EvalGuard
from engine.batch_caches import cache_arrays, left_pad, merged, roll_back
from engine.batch_sampler import Sampled, sample
from engine.compiled_decode import CompiledDecode
from engine.forward_order import ForwardOrder
from engine.memory_report import MemoryReport
from engine.prefill_group import LAST_TOKEN_ALONE, Finished, Prefill, fresh_group
from engine.prefix_store import PrefixStore
from engine.quantized_kv import make_caches
from engine.step_plan import (
    Insert,
    Sampling,
    StepPlan,
    StepResult,
    batch_fingerprint,
    step_width,
)

PHASE_PREFILL = 0
PHASE_DECODE = 1


class PlanMismatchError(Exception):
    """This rank's batch differs from rank 0's; the job must stop."""


@dataclass(eq=False)
class PendingStep:
    """A step whose graph is built and computing; `wait()` finishes it."""

    engine: BatchEngine
    seq_ids: list[int]
    logits: mx.array | None
    sampled: Sampled | None
    prefill_tokens: int
    finished: list[Finished]
    arrays: list[mx.array]
    widths: list[int]
    eager: bool  # its decode forward ran eagerly (not compiled)

    def wait(self) -> StepResult:
        """Wait for the step (under the collective watchdog); the prefilled join the batch."""
        engine = self.engine
        if self.arrays:
            engine._eval(self.arrays)
        for entries, _, batch_cache in self.finished:
            engine._join(entries, batch_cache)
        engine.step_index += 1
        if engine.memory.due():  # the heap's free pages back (engine/memory_report.py)
            caches = [engine._decode_cache or [], *(p.cache for p in engine.prefilling)]
            engine.memory.upkeep(caches, engine.prefix.nbytes, engine.compiled)
        return StepResult(
            self.seq_ids,
            self.logits,
            self.prefill_tokens,
            self.sampled,
            self.widths,
            prefill_forwards=engine.last_prefill,
            eager=self.eager,
            prefix_bytes=engine.prefix.nbytes,
        )


class BatchEngine:
    """The batch every rank steps in lock-step."""

    def __init__(
        self,
        model: Callable[..., mx.array],
        prefill_chunk_size: int,
        guard: EvalGuard | None = None,
        compiled: CompiledDecode | None = None,
        prefix: PrefixStore | None = None,  # with its KV_CACHE_BITS and disk tier
    ) -> None:
        self.model, self.compiled = model, compiled
        self.prefill_chunk_size = prefill_chunk_size
        self.prefill_budget = prefill_chunk_size  # this step's, from the plan
        self.last_prefill: list[tuple[int, int]] = []  # this step's (cached, tokens) forwards
        self._guard = guard
        self.step_index = 0
        self.decode_ids: list[int] = []
        self.decode_lengths: list[int] = []
        self._decode_cache: list | None = None
        self._next_tokens: list[int] = []
        self._drafts: list[list[int]] = []
        self.prefilling: list[Prefill] = []
        self.prefix = prefix or PrefixStore()
        self.memory = MemoryReport()
        # A model whose calls evaluate their own collectives in order (a pipeline's stages)
        # may hand results back later in a step; its forwards need no links.
        later = getattr(model, "results_later", None)
        self._results_later = later or nullcontext
        self._order = ForwardOrder(linked=later is None)

    # ---- bookkeeping -------------------------------------------------------------

    @property
    def kv_tokens(self) -> int:
        """Positions held in the caches of the running batch (decoding and prefilling)."""
        return sum(self.decode_lengths) + sum(p.length for p in self.prefilling)

    @property
    def size(self) -> int:
        """Sequences held (decoding and prefilling)."""
        return len(self.decode_ids) + len(self.prefilling)

    def fingerprint(self) -> int:
        """Digest of the batch this rank holds now (before the next plan)."""
        pairs = zip(self.decode_ids, self.decode_lengths, strict=True)
        entries = [(s, PHASE_DECODE, n) for s, n in pairs]
        entries += [(p.seq_id, PHASE_PREFILL, p.length) for p in self.prefilling]
        return batch_fingerprint(self.step_index, entries, self.prefix.digest())

    def check(self, plan: StepPlan) -> None:
        """Raise PlanMismatchError when rank 0's batch is not ours."""
        if plan.step != self.step_index or plan.fingerprint != self.fingerprint():
            raise PlanMismatchError(
                f"batch fingerprint mismatch at step {self.step_index} (plan step "
                f"{plan.step}): this rank holds {len(self.decode_ids)} decoding "
                f"{self.decode_ids[:8]} and {len(self.prefilling)} prefilling sequences, "
                "which differs from rank 0's batch"
            )

    def apply(self, plan: StepPlan) -> list[tuple[int, int, bool]]:
        """Roll back, evict, store, remove, set the next tokens, queue inserts (no forward);
        the plan's disk loads as every rank voted: (entry, disk key, loaded)."""
        if plan.rollbacks:
            self._roll_back(plan.rollbacks)
        for entry in plan.evicts:
            self.prefix.drop(entry)
        for store in plan.stores:
            self._store(store.seq_id, store.entry, store.length)
        self.prefix.apply_disk(plan.saves, plan.loads, plan.drops)
        removes = set(plan.removes)
        if removes:
            self.prefilling = [p for p in self.prefilling if p.seq_id not in removes]
            keep = [i for i, s in enumerate(self.decode_ids) if s not in removes]
            if len(keep) != len(self.decode_ids):
                self.decode_ids = [self.decode_ids[i] for i in keep]
                self.decode_lengths = [self.decode_lengths[i] for i in keep]
                if not keep:
                    self._decode_cache = None
                else:
                    assert self._decode_cache is not None
                    index = mx.array(keep)
                    for layer in self._decode_cache:
                        layer.filter(index)
        if len(plan.tokens) != len(self.decode_ids):
            raise PlanMismatchError(
                f"plan for step {plan.step} carries {len(plan.tokens)} next tokens for "
                f"a decode batch of {len(self.decode_ids)} on this rank"
            )
        self._next_tokens = list(plan.tokens)
        self._drafts = plan.drafts if any(plan.drafts) else []
        self.prefill_budget = self.prefill_chunk_size if plan.prefill is None else plan.prefill
        for insert in plan.inserts:
            self.prefilling.append(self._start(insert))
        return self.prefix.loaded

    def _roll_back(self, drops: list[int]) -> None:
        """Drop each decoding row's unaccepted positions from the previous step."""
        if len(drops) != len(self.decode_ids) or self._decode_cache is None:
            raise PlanMismatchError(
                f"plan for step {self.step_index} rolls back {len(drops)} rows; this rank "
                f"decodes {len(self.decode_ids)}"
            )
        try:
            roll_back(self._decode_cache, drops)
        except TypeError as exc:
            raise PlanMismatchError(f"cannot roll back a speculative step: {exc}") from None
        self.decode_lengths = [n - d for n, d in zip(self.decode_lengths, drops, strict=True)]

    def _start(self, insert: Insert) -> Prefill:
        entry = Prefill(insert.seq_id, insert.tokens, insert.prefix_len, insert.store_as)
        if insert.prefix_entry:
            if insert.prefix_entry not in self.prefix.entries:
                raise PlanMismatchError(
                    f"sequence {insert.seq_id} starts from prefix entry "
                    f"{insert.prefix_entry}, which this rank does not hold"
                )
            entry.cache = self.prefix.caches(insert.prefix_entry, insert.prefix_len)
        return entry

    def _store(self, seq_id: int, entry: int, length: int) -> None:
        """Keep a sequence's first `length` positions as prefix entry `entry`: a decoding
        one's, or what a prefilling one (cancelled mid-prompt) holds so far."""
        prefilling = {p.seq_id: p for p in self.prefilling}
        if seq_id in prefilling:
            held, rows = prefilling[seq_id].length, prefilling[seq_id].cache
        elif seq_id in self.decode_ids and self._decode_cache is not None:
            row = self.decode_ids.index(seq_id)
            held = self.decode_lengths[row]
            rows = [layer.extract(row) for layer in self._decode_cache]
        else:
            raise PlanMismatchError(f"cannot store sequence {seq_id}: this rank does not hold it")
        if length > held:
            raise PlanMismatchError(
                f"cannot store {length} positions of sequence {seq_id}: it holds {held} on "
                "this rank"
            )
        mx.eval(self.prefix.put(entry, rows, length))

    # ---- compute -----------------------------------------------------------------

    def _forward(self, tokens: mx.array, cache: list) -> mx.array:
        logits = self.model(self._order.next(tokens), cache=cache)[:, -1, :]
        return self._order.ran([logits])[0]

    def run(self, sampling: Sampling | None = None) -> StepResult:
        """Decode one token for the batch and prefill up to the chunk budget; eval all."""
        return self.start(sampling).wait()

    def start(self, sampling: Sampling | None = None) -> PendingStep:
        """Build the step's graph (decode, prefill chunks, and with `sampling` the sampled
        tokens) and start computing it; the caller may work meanwhile, then `wait()`."""
        seq_ids = list(self.decode_ids)
        self._order.start_step()
        with self._results_later():  # a pipeline's stage 0 works while the last stage ends
            rows, widths = self._decode()
            prefill_tokens, finished, stored = self._prefill()
        pending = []
        for entries, last, shared in finished:
            rows.append(last)
            seq_ids += [e.seq_id for e in entries]
            widths += [1] * len(entries)
            pending += cache_arrays(shared if shared is not None else entries[0].cache)
        output = mx.concatenate(rows, axis=0) if rows else None
        sampled = None
        arrays: list[mx.array] = []
        if output is not None:
            # Every rank evaluates the same list first (engine/forward_order.py); rank 0
            # adds its sampling (no collectives) after it.
            arrays = [output, *pending, *stored]
            # Under the watchdog too: on MLX's CPU backend much of the evaluation (its
            # all_sums included) runs before async_eval returns, so a stalled peer can
            # block here, not only in wait() (a SIGSTOPped worker hung rank 0 this way).
            with self._guarded():
                mx.async_eval(arrays)
                if sampling is not None:
                    sampled = sample(output, sampling(seq_ids, widths))
                    arrays += sampled.arrays()
                    mx.async_eval(sampled.arrays())
        eager = self.compiled is None or not self.compiled.enabled
        return PendingStep(
            self, seq_ids, output, sampled, prefill_tokens, finished, arrays, widths, eager
        )

    def _decode(self) -> tuple[list[mx.array], list[int]]:
        """The decoding rows' forward (a speculative step's verify; compiled where it
        applies): its logits, none without a decode batch, and each row's positions."""
        if self._decode_cache is None:
            return [], []
        if self._drafts:
            width = step_width(self._drafts)
            logits = self._verify(width)
        else:
            width = 1
            inputs = mx.array(self._next_tokens, dtype=mx.uint32)[:, None]
            compiled = self.compiled.step(inputs, self._decode_cache) if self.compiled else None
            logits = compiled if compiled is not None else self._forward(inputs, self._decode_cache)
        self.decode_lengths = [n + width for n in self.decode_lengths]
        self._order.ran([logits])
        return [logits], [width] * len(self.decode_ids)

    def _prefill(self) -> tuple[int, list[Finished], list[mx.array]]:
        """The step's prompt chunks within the plan's budget: the tokens prefilled, the
        prompts finished (with their last positions' logits and their batch cache or None)
        and the prefix entries they store."""
        budget, prefill_tokens, self.last_prefill = self.prefill_budget, 0, []
        finished: list[Finished] = []
        stored: list[mx.array] = []  # prompts kept as prefix entries this step
        # A burst of short prompts arriving while no answer runs prefills in one batched
        # forward, whatever its total (8 clients at once each waited for its share of three
        # steps before); beside answers, the budget keeps their next tokens from waiting.
        group = fresh_group(
            self.prefilling,
            self.prefill_chunk_size,
            budget if self._decode_cache is not None else None,
        )
        if len(group) > 1:
            logits, cache = self._prefill_together(group)
            finished.append((group, logits, cache))
            width = max(len(e.tokens) for e in group)
            budget -= len(group) * width
            self.last_prefill.append((max(e.prefix_len for e in group), len(group) * width))
            prefill_tokens += sum(len(e.tokens) for e in group)
            stored += self._store_group(group, cache)
        for entry in self.prefilling:
            if budget <= 0:
                break
            if len(group) > 1 and entry in group:
                continue
            if not entry.cache:
                entry.cache = make_caches(self.model, self.prefix.bits)
            end = min(len(entry.tokens), entry.position + budget)
            chunk = mx.array(entry.tokens[entry.position : end], dtype=mx.uint32)[None]
            if end == len(entry.tokens) and chunk.shape[1] > LAST_TOKEN_ALONE:
                self.model(self._order.next(chunk[:, :-1]), cache=entry.cache)  # read: cache
                self._order.ran(cache_arrays(entry.cache))
                chunk = chunk[:, -1:]
            logits = self._forward(chunk, entry.cache)
            self.last_prefill.append((entry.length, end - entry.position))
            budget -= end - entry.position
            prefill_tokens += end - entry.position
            entry.position = end
            if end == len(entry.tokens):
                finished.append(([entry], logits, None))
                if entry.store_as:
                    stored += self.prefix.put(entry.store_as, entry.cache, entry.length)
            else:
                # Evaluate per chunk so the lazy graph of a long prompt stays small.
                self._eval(self._order.ran(cache_arrays(entry.cache)))
        return prefill_tokens, finished, stored

    def _verify(self, width: int) -> mx.array:
        """One forward (compiled where it applies) over each decoding row's next token and
        its draft, padded on the right to `width` with the next token (the padding's logits
        are never used, and the next plan rolls its positions back): [rows x width, V],
        row-major."""
        inputs = [
            [token, *draft, *[token] * (width - 1 - len(draft))]
            for token, draft in zip(self._next_tokens, self._drafts, strict=True)
        ]
        tokens = mx.array(inputs, dtype=mx.uint32)
        assert self._decode_cache is not None  # only a decode batch verifies
        compiled = self.compiled.step(tokens, self._decode_cache) if self.compiled else None
        if compiled is not None:
            return compiled
        with computing(width):
            logits = self.model(tokens, cache=self._decode_cache)
        logits = logits[:, -width:, :]
        return logits.reshape(-1, logits.shape[-1])

    def _prefill_together(self, group: list[Prefill]) -> tuple[mx.array, list]:
        """One forward for several prompts' rests, left-padded into one batch cache after
        their cached prefixes (rows of different prefix lengths are left-padded too)."""
        width = max(len(e.tokens) for e in group)
        padding = [width - len(e.tokens) for e in group]
        tokens = mx.array([[0] * p + e.tokens for p, e in zip(padding, group, strict=True)])
        cache = merged([e.cache or make_caches(self.model, self.prefix.bits) for e in group])
        left_pad(cache, padding)
        for entry in group:
            entry.position = len(entry.tokens)
        return self._forward(tokens.astype(mx.uint32), cache), cache

    def _store_group(self, group: list[Prefill], cache: list | None) -> list[mx.array]:
        """Keep the prompts of a batched prefill that asked for it, row by row."""
        arrays: list[mx.array] = []
        for row, entry in enumerate(group):
            if entry.store_as and cache is not None:
                rows = [layer.extract(row) for layer in cache]
                arrays += self.prefix.put(entry.store_as, rows, entry.length)
        return arrays

    def _eval(self, arrays: list) -> None:
        with self._guarded():
            mx.eval(arrays)

    def _guarded(self) -> AbstractContextManager:
        """The collective watchdog around an evaluation (nothing when there is none)."""
        if self._guard is None:
            return nullcontext()
        return self._guard("forward pass (all_sum inside sharded layers)")

    def _join(self, entries: list[Prefill], cache: list | None) -> None:
        """Move finished prompts into the decode batch (cache: their batch cache, if any)."""
        for entry in entries:
            self.prefilling.remove(entry)
        if cache is None:
            cache = merged([entries[0].cache])
        if self._decode_cache is None:
            self._decode_cache = cache
        else:
            for mine, theirs in zip(self._decode_cache, cache, strict=True):
                mine.extend(theirs)
        self.decode_ids += [e.seq_id for e in entries]
        self.decode_lengths += [e.length for e in entries]

    def advance_idle(self) -> None:
        """Count a step that ran no compute (sleep/stop plans) so step numbers agree."""
        self.step_index += 1
