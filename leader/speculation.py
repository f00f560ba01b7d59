"""Rank 0's speculative decoding: proposals (prompt lookup, a draft model), acceptance,
rollbacks, figures.

Each step rank 0 may propose, for a decoding row, up to SPEC_TOKENS tokens to follow its
next token: first by prompt lookup (leader/prompt_lookup.py: the continuation of an earlier
place in the conversation or the answer that the row's latest tokens repeat; it costs
nothing). Where prompt lookup proposes nothing for a row and DRAFT_MODEL is set, the draft
model proposes its greedy continuation (leader/draft_model.py, on rank 0 alone). The
per-step rule (leader/spec_rule.py) decides how many positions a step verifies, from each
row's recent evidence, how long its match has held and the step's cost (a draft's
forwards included). Prompt lookup's proposals beyond those verified are checked for free
against what the step sampled (the `shadow` trial): a row the rule leaves out is still
measured. The proposals travel in the step plan; every rank runs one forward over each
row's next token and its proposals (engine/batch_engine.py), and rank 0 samples every
position as if it were the next token: position j with the key of the request's
(drawn + j)-th token.

Acceptance: proposal j+1 is kept while it equals what position j sampled; the row takes the
kept proposals and the token sampled after the last of them, and the next plan rolls back
the rest of the positions the step wrote. Greedy rows: the argmax, so the answer is the one
speculation off gives. Sampled rows: position j's draw is a Gumbel-max draw from the
model's distribution p (after temperature, top_k, top_p, min_p), keyed as the token would be
without speculation. The proposal t is kept exactly when that draw is t: probability p(t),
the speculative-sampling papers' acceptance for a proposal distribution that is a point mass
on t (min(1, p(t)/q(t)) with q(t) = 1); when rejected, the draw is some other token, whose
distribution given "not t" is p with t removed and renormalised: the papers' residual
max(0, p - q), normalised. So every token follows p, and a seeded request gives the same
tokens whatever shares its batch, and whether or not speculation is on.

A draft model's proposals are its argmax: point masses too, so the same holds for them.

Every row may speculate: penalties, a grammar and logprobs at position j are those of the
plain step that would reach it, the proposals before j taken as drawn (their penalties
count them, the grammar is advanced past them: leader/sampler.py `rows_after`), so a row
gets the same tokens and logprobs either way. A grammar's row proposes only the run it
allows, and where the grammar forces its next tokens (a forced call's `{"name":
"edit_file", "arguments": {"path":`, 14 of SmolLM2's tokens; the keys between a schema's
values), those: they are accepted as often as the model writes the grammar's own
tokenization (`forced_odds`, counted apart). A model whose caches cannot roll back runs
without speculation.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from mlx_lm.models.cache import KVCache

from engine.batch_sampler import RowSampling
from engine.step_plan import step_width
from ipc.status import SpeculationStats
from leader.draft_model import DraftModel
from leader.prompt_lookup import PromptLookup
from leader.request import Request
from leader.spec_rule import Evidence, Figures, MatchOdds, StepCosts, choose_width

log = logging.getLogger("ring.speculation")


@dataclass
class Speculator:
    """Rank 0's proposals and what came of them; `tokens` 0 (or a `refusal`): off.
    `draft`: the draft model that proposes where prompt lookup has nothing (or None, and
    `draft_reason` says why DRAFT_MODEL is not used)."""

    tokens: int
    refusal: str | None = None
    rule: bool = True  # the per-step rule decides (SPECULATIVE=auto); False: always propose
    draft: DraftModel | None = None
    draft_reason: str = ""
    totals: Figures = field(default_factory=Figures)
    draft_totals: Figures = field(default_factory=Figures)  # the draft model's proposals
    costs: StepCosts = field(default_factory=StepCosts)  # the per-step rule's (spec_rule.py)
    odds: MatchOdds = field(default_factory=MatchOdds)  # the rule's, by a match's length
    _lookup: dict[int, PromptLookup] = field(default_factory=dict)
    _evidence: dict[int, Evidence] = field(default_factory=dict)  # each row's, for the rule
    _drafts: dict[int, list[int]] = field(default_factory=dict)  # the step's, by seq id
    _ahead: dict[int, list[int]] = field(default_factory=dict)  # prompt lookup's, unverified
    _drops: dict[int, int] = field(default_factory=dict)  # positions to roll back
    _drafted: set[int] = field(default_factory=set)  # rows the draft model proposed for
    _forced: set[int] = field(default_factory=set)  # rows proposing their grammar's tokens
    # theirs, counted apart at one length (the latest HELD_MEMORY trials weighing)
    forced_odds: MatchOdds = field(default_factory=MatchOdds)
    new_shape: bool = False  # the planned step makes a new compiled shape
    proposing: bool = True  # False: no proposals of its own (the warm-up forces widths)

    @property
    def enabled(self) -> bool:
        return self.tokens > 0 and self.refusal is None

    def stats(self) -> SpeculationStats:
        """The totals, for status."""
        totals = self.totals
        return SpeculationStats(
            enabled=self.enabled,
            reason=self.refusal or ("" if self.enabled else "SPECULATIVE=off"),
            spec_tokens=self.tokens,
            proposed_tokens=totals.proposed,
            accepted_tokens=totals.accepted,
            acceptance_rate=round(totals.acceptance_rate, 4),
            tokens_per_step=round(totals.tokens_per_step, 4),
            draft_model=self.draft.name if self.draft is not None and self.enabled else "",
            draft_reason=self.draft_reason,
            draft_proposed_tokens=self.draft_totals.proposed,
            draft_accepted_tokens=self.draft_totals.accepted,
        )

    def drafts(self, seq_ids: list[int], requests: dict[int, Request]) -> list[list[int]]:
        """The proposals of the next step's decode rows (all empty: none this step)."""
        self._drafts, self._drafted, self._forced, self._ahead = {}, set(), set(), {}
        self.new_shape = False
        for gone in (self._lookup.keys() | self._evidence.keys()) - requests.keys():
            self._lookup.pop(gone, None)
            self._evidence.pop(gone, None)
        if self.draft is not None:
            self.draft.forget(requests)
        if not self.enabled:
            return []
        out: list[list[int]] = []
        asks: dict[int, tuple[list[int], int]] = {}  # row: (history, most) for the draft
        for row, seq_id in enumerate(seq_ids):
            request = requests.get(seq_id)
            draft: list[int] = []
            if request is not None and not request.finished and self.proposing:
                lookup = self._lookup.setdefault(seq_id, PromptLookup())
                history = [*request.prompt, *request.generated]
                lookup.extend(history[len(lookup) :])
                most = min(self.tokens, request.max_tokens - len(request.generated) - 1)
                draft = request.sampler.forced()[: max(0, most)]  # a grammar's next tokens
                if draft:
                    self._forced.add(seq_id)
                else:
                    draft = self._ahead[seq_id] = request.sampler.allowed(lookup.propose(most))
                if not draft and most > 0 and self.draft is not None:
                    asks[row] = (history, most)
            out.append(draft)
        width = 1 + self.tokens
        # the batch's cached positions: its longest row's (the others are padded to it)
        decoding = [requests[seq_id] for seq_id in seq_ids if seq_id in requests]
        cached = max((len(r.prompt) + len(r.generated) - 1 for r in decoding), default=0)
        if (any(out) or asks) and self.rule:  # how wide a step pays (leader/spec_rule.py)
            ms = self.draft.token_ms if self.draft is not None else 0.0
            # a draft's forward, and a grammar's mask at each later position
            masks = [requests[s].sampler.proposal_ms if s in requests else 0.0 for s in seq_ids]
            making = [(ms if row in asks else 0.0) + mask for row, mask in enumerate(masks)]
            width = choose_width(self._chances(seq_ids, out, asks), self.costs, making, cached)
            out = [draft[: width - 1] for draft in out]
        for row, (history, most) in asks.items():
            if self.draft is None:
                break
            try:
                proposed = self.draft.propose(seq_ids[row], history, min(most, width - 1))
                out[row] = requests[seq_ids[row]].sampler.allowed(proposed)
            except Exception as exc:  # the draft's trouble must never stop the step loop
                self._drop_draft(exc)
                break
            if out[row]:
                self._drafted.add(seq_ids[row])
        self._drafts = dict(zip(seq_ids, out, strict=True))
        self.new_shape = self.costs.shapes.take(len(seq_ids), step_width(out), cached)
        return out if any(out) else []

    def observe(self, rows: int, eager: bool, ms: float) -> None:
        """The planned decode step (`rows` rows x positions) took `ms`: the rule's costs."""
        self.costs.observe(rows, eager, ms, new_shape=self.new_shape)

    def _chances(
        self, seq_ids: list[int], out: list[list[int]], asks: dict[int, tuple[list[int], int]]
    ) -> list[list[float]]:
        """Each row's proposals' chances for the rule: a prompt-lookup match's by how long it
        has held and the row's recent trials; a draft model's (no match) by the trials."""
        chances = []
        for row, seq_id in enumerate(seq_ids):
            recent = self._evidence.get(seq_id, Evidence()).rate
            if row in asks:
                chances.append([recent] * asks[row][1])
            elif seq_id in self._forced:
                chances.append([self.forced_odds.chance(0)] * len(out[row]))
            elif out[row]:
                chances.append(self.odds.chances(self._lookup[seq_id].run, len(out[row]), recent))
            else:
                chances.append([])
        return chances

    def _drop_draft(self, exc: Exception) -> None:
        """Serve on with prompt lookup alone after the draft model failed."""
        assert self.draft is not None
        self.draft_reason = f"DRAFT_MODEL={self.draft.name} failed ({type(exc).__name__}: {exc})"
        log.error(
            "draft model dropped: %s; speculation uses prompt lookup alone", self.draft_reason
        )
        self.draft = None

    def rollbacks(self, decode_ids: list[int]) -> list[int]:
        """Per decoding row (before the plan's removes), the positions it drops."""
        if not self._drops:
            return []
        drops = [self._drops.get(seq_id, 0) for seq_id in decode_ids]
        self._drops = {}
        return drops if any(drops) else []

    def sampling(self, seq_id: int, width: int, request: Request | None) -> list[RowSampling]:
        """How to sample a row's positions after its first in a step `width` wide: its
        proposals' as the plain steps reaching them would (leader/sampler.py
        `rows_after`), the padding after them greedily (what it samples is never read)."""
        if request is None or request.finished:
            return [RowSampling()] * (width - 1)
        rows = request.sampler.rows_after(self._drafts.get(seq_id, []))
        return rows + [RowSampling()] * (width - 1 - len(rows))

    def accept(self, seq_id: int, drawn: list[int], request: Request | None) -> int:
        """How many of a row's sampled positions it takes (any step, one position or
        more): the proposals equal to what the position before sampled, and one more.
        The rest roll back at the next plan. Its trials feed the rule: a grammar's forced
        tokens their own odds, the others the row's evidence and the odds by a match's
        length."""
        draft = self._drafts.get(seq_id, [])
        kept = 0
        while kept < len(draft) and drawn[kept] == draft[kept]:
            kept += 1
        self._drops[seq_id] = len(drawn) - 1 - kept
        if seq_id in self._forced:  # a grammar's tokens: their own odds, not the row's
            for at in range(min(kept + 1, len(draft))):
                self.forced_odds.trial(0, at < kept)
        else:
            self._lookup_trials(seq_id, draft, drawn, kept)
        if draft:
            for figures in self._figures(request):
                figures.proposed += len(draft)
                figures.accepted += kept
                figures.rejections += kept < len(draft)
        if seq_id in self._drafted:
            self.draft_totals.proposed += len(draft)
            self.draft_totals.accepted += kept
        return kept + 1

    def _lookup_trials(self, seq_id: int, draft: list[int], drawn: list[int], kept: int) -> None:
        """The row's evidence and the odds by a match's length take the verified run and,
        where it was all accepted, the shadow trial of prompt lookup's next proposal (the
        token sampled after the run against it)."""
        evidence = self._evidence.setdefault(seq_id, Evidence())
        ahead = self._ahead.get(seq_id, [])
        evidence.verified(kept, len(draft))
        looked_up = seq_id not in self._drafted and seq_id in self._lookup
        held = self._lookup[seq_id].run if looked_up else 0
        for at in range(min(kept + 1, len(draft)) if looked_up else 0):
            self.odds.trial(held + at, at < kept)
        if kept == len(draft) and len(ahead) > kept:
            evidence.trial(drawn[kept] == ahead[kept])
            self.odds.trial(held + kept, drawn[kept] == ahead[kept])
        elif not draft:
            evidence.idle()

    def count(self, request: Request | None, taken: int) -> None:
        """A decode step gave `request` `taken` tokens."""
        for figures in self._figures(request):
            figures.steps += 1
            figures.tokens += taken

    def _figures(self, request: Request | None) -> list[Figures]:
        return [self.totals] + ([request.speculation] if request is not None else [])


def rollback_refusal(caches: list[Any], sliding_layers: tuple[int, ...]) -> str | None:
    """Why speculation cannot run with these caches (rank 0's, one per layer it holds; and
    the model's sliding-window layers, which pipeline ranks may hold): None when it can."""
    if sliding_layers:
        return "sliding-window layers keep rotating caches, which cannot roll back positions"
    kinds = sorted({type(cache).__name__ for cache in caches if type(cache) is not KVCache})
    if kinds:
        return f"{', '.join(kinds)} caches cannot roll back positions (only plain KV caches)"
    return None
