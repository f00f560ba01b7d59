"""Rank 0's warm-up: the forwards a first request would compile and trace, run before rank 0
reports ready (WARM_UP=auto).

A compiled graph pays on its first use: MLX's CPU backend compiles each fused kernel with
the system compiler and keeps it under $TMPDIR/mlx/<version>/cpu (a machine whose /tmp was
emptied starts without any; Metal and CUDA compile their kernels on first use too), and
every new input shape of the compiled decode step is traced (engine/compiled_decode.py).
Measured: the first request after a start on an empty kernel cache took many times as long
as the next ones (docs/BENCHMARKS.md, "The first request after a start or a restart" and
"Figures behind the code").
Kernels are named by their operations and by how their inputs collapse (contiguous, or
strided over N dimensions), not by sizes, so a few shapes of each kind of forward compile
them all. Rank 0 runs them as requests of its own through the real step loop, so every
rank runs them in lock-step, as it runs any request:

1. one chat whose prompt is longer than LAST_TOKEN_ALONE (a prefill, then its last token
   alone), decoding at every width a speculative step takes (1 to 1 + SPEC_TOKENS, each
   then rolled back), then at width 1 again;
2. one prompt prefilled WARM_CHUNK tokens a step (a chunk over a filled cache: what a long
   prompt's later chunks and a prefix hit's rest compute);
3. two requests together (one batched prefill of left-padded rows), one sampled with
   temperature, top_p, top_k, a seed and a penalty, the other greedy with logprobs,
   decoding as a batch of 2 at widths 1, 2 and the widest.

Widths are forced: rank 0 puts proposals (the row's own next token) in the step plan. The
speculator proposes nothing of its own meanwhile, so it takes every proposal as padding:
none is accepted and the next plan rolls them back, as it does a rejected proposal.
Isolation: while warming, the prefix cache is off (nothing is stored, on disk either), EOS
ends no warm-up answer, the loop keeps no step time (speculation's step costs, the prefill
budget), and the counters and speculation totals are put back as they were; rank 0's
socket refuses submits (status "warming").

Last, with the prefix cache back on, one more request of rank 0's own prefills the chat
template's opening, what every one-message chat starts with (the template's default
system prompt where it has one, 24 tokens for SmolLM2), so that a first request reuses it
as later ones do: measured, with the prefix cache off the first request took as long as
the tenth identical one (1.05x), with it on 1.2-2.3x, the tenth having its whole prompt
cached (docs/BENCHMARKS.md, "The first request after a start or a restart"). A chat with a
system prompt of its own shares only the template's first tokens with it. Its prefill is
not counted as a hit or a miss, nor saved to disk (it is primed again at every start).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from engine.step_plan import StepPlan
from ipc.events import KEEP_WARM
from ipc.protocol import ChatMessage, SamplingParams, Submit
from leader.prefix_cache import PrefixCache
from leader.prefix_index import shared_prefix
from leader.request import Request
from leader.request_setup import Refusal
from leader.requests import Requests
from leader.scheduler import Scheduler
from leader.spec_rule import MAX_ROWS

log = logging.getLogger("ring.warmup")

WARM_CHUNK = 24  # prompt tokens a step in phase 2: three chunks for its prompt
FILLER = "Warm the kernels up with this sentence about rivers, stones and quiet light. "
# Two first messages that share no first character: what their prompts share is the
# template's opening.
HEAD_PROBES = ("Where is the harbour?", "2 + 2 = ?")


@dataclass
class WarmRequest:
    """One of the warm-up's requests: what it sends and the width of each decode step."""

    submit: Submit
    widths: list[int] = field(default_factory=list)  # then 1


@dataclass
class Phase:
    """Requests submitted together; `chunk`: the prefill's tokens a step (None: as usual)."""

    requests: list[WarmRequest]
    chunk: int | None = None


def _filler(words: int) -> str:
    text = FILLER * (1 + words // len(FILLER.split()))
    return " ".join(text.split()[:words])


class WarmUp:
    """The phases, submitted one after another once the last one's requests ended."""

    def __init__(self, widest: int, batch: int, context: int) -> None:
        self.widest = max(1, widest)  # 1 + SPEC_TOKENS where speculation runs, else 1
        self.context = context
        self.phases = self._phases(min(batch, 2))
        self.by_id: dict[str, WarmRequest] = {}
        self.current: Phase | None = None
        self.steps = 0
        self.submitted = 0

    def _phases(self, batch: int) -> list[Phase]:
        top = self.widest
        spread = list(range(2, top + 1))
        one = WarmRequest(
            Submit(
                id="warm-up-1",
                messages=[
                    ChatMessage(role="system", content="You answer in one short sentence."),
                    ChatMessage(role="user", content=_filler(16)),
                ],
                params=SamplingParams(max_tokens=len(spread) + 3, logprobs=True),
            ),
            widths=[1, *spread, 1],
        )
        chunked = WarmRequest(
            Submit(
                id="warm-up-2",
                prompt=_filler(3 * WARM_CHUNK),
                params=SamplingParams(max_tokens=2, repetition_penalty=1.1),
            )
        )
        phases = [Phase([one]), Phase([chunked], chunk=WARM_CHUNK)]
        if batch < 2:
            return phases
        wide = [w for w in dict.fromkeys([2, top]) if 2 <= w <= top and 2 * w <= MAX_ROWS]
        sampled = SamplingParams(
            max_tokens=len(wide) + 3,
            temperature=0.7,
            top_p=0.9,
            top_k=20,
            seed=1,
            presence_penalty=0.1,
        )
        pair = [
            WarmRequest(
                Submit(
                    id="warm-up-3",
                    messages=[ChatMessage(role="user", content=_filler(12))],
                    params=sampled,
                ),
                widths=[1, *wide, 1],
            ),
            WarmRequest(
                Submit(
                    id="warm-up-4",
                    prompt=_filler(16),
                    params=SamplingParams(max_tokens=len(wide) + 3, logprobs=True, top_logprobs=2),
                ),
                widths=[1, *wide, 1],
            ),
        ]
        return [*phases, Phase(pair)]

    def submit_next(self, requests: Requests) -> bool:
        """Queue the next phase's requests (those the context holds); False when none is
        left."""
        while self.phases:
            self.current = self.phases.pop(0)
            queued = 0
            for warm in self.current.requests:
                if self._fits(warm, requests):
                    self.by_id[warm.submit.id] = warm
                    requests.submit(KEEP_WARM, warm.submit)
                    queued += 1
            self.submitted += queued
            if queued:
                return True
        self.current = None
        return False

    def _fits(self, warm: WarmRequest, requests: Requests) -> bool:
        try:
            prompt = requests.setup.prepare(warm.submit).prompt
        except Refusal as refusal:
            log.debug("warm-up request %s left out: %s", warm.submit.id, refusal)
            return False
        needs = len(prompt) + warm.submit.params.max_tokens + max(warm.widths, default=1)
        if needs > self.context:
            log.debug("warm-up request %s left out: the context is too short", warm.submit.id)
        return needs <= self.context

    def adjust(self, plan: StepPlan, decoding: list[int], requests: Requests) -> None:
        """Force this step's widths (proposals the speculator never made, so never
        accepted) and the phase's prefill chunk; `decoding`: the plan's decode rows."""
        self.steps += 1
        chunk = self.current.chunk if self.current is not None else None
        if chunk is not None:
            plan.prefill = min(plan.prefill or chunk, chunk)
        if self.widest < 2 or not decoding:
            return
        widths = [self._width(requests.active.get(seq_id)) for seq_id in decoding]
        top = min(max(widths), MAX_ROWS // len(decoding))
        if top < 2:
            return
        plan.drafts = [[token] * (top - 1) for token in plan.tokens]

    def _width(self, request: Request | None) -> int:
        warm = self.by_id.get(request.id) if request is not None else None
        if request is None or warm is None:
            return 1
        step = len(request.generated) - 1  # one token a step: none is ever accepted
        return warm.widths[step] if 0 <= step < len(warm.widths) else 1


@contextmanager
def isolated(scheduler: Scheduler) -> Iterator[None]:
    """The scheduler as the warm-up needs it: no prefix cache, no end at EOS, no proposals
    but the warm-up's, and the speculation totals put back afterwards."""
    prefix, eos = scheduler.prefix, scheduler.eos_ids
    speculator = scheduler.speculator
    totals, drafted = copy.deepcopy(speculator.totals), copy.deepcopy(speculator.draft_totals)
    scheduler.requests.prefix = PrefixCache(0)
    scheduler.eos_ids = set()
    speculator.proposing = False
    try:
        yield
    finally:
        scheduler.requests.prefix = prefix
        scheduler.eos_ids = eos
        speculator.proposing = True
        speculator.totals, speculator.draft_totals = totals, drafted


def template_head(requests: Requests) -> list[int]:
    """The tokens every one-message chat starts with (none where the template cannot render
    one): the shared start of two such chats' prompts."""
    prompts = []
    for text in HEAD_PROBES:
        submit = Submit(
            id="warm-up-head",
            messages=[ChatMessage(role="user", content=text)],
            params=SamplingParams(max_tokens=1),
        )
        try:
            prompts.append(requests.setup.prepare(submit).prompt)
        except Refusal:
            return []
    first, second = prompts
    return first[: shared_prefix(first, second)]


def opening(requests: Requests) -> list[int]:
    """The template's opening to prime, or none: where the prefix cache is off, or the
    opening is shorter than an entry's minimum, or leaves no room in the context."""
    head = template_head(requests)
    index = requests.prefix.index
    fits = index.min_tokens <= len(head) < min(index.budget_tokens, requests.max_sequence_length)
    return head if requests.prefix.enabled and fits else []


@contextmanager
def uncounted(prefix: PrefixCache) -> Iterator[None]:
    """The prefix cache's hit and miss counters as they were before."""
    counts = prefix.hits, prefix.hit_tokens, prefix.misses
    try:
        yield
    finally:
        prefix.hits, prefix.hit_tokens, prefix.misses = counts
