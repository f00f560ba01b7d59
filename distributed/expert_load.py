"""The routed experts' load as serving meets it: in an expert split every rank routes every
token (distributed/expert_parallel.py), so rank 0 counts each MoE layer's routes per expert,
and the step-time model predicts the busiest rank's share from them (distributed/
step_model.py), where before the first routes it takes every expert as popular as the next;
and what a forward's routes cost each rank, in expert reads (`routed_reads`).

Why: each MoE layer ends in an all_sum that waits for the rank with the most routes. A
router is rarely even: the bench's MoE model (random weights, 16 experts, 2 ranks) sent
51-74% of a prompt's routes to one rank's half, 60% over its 8 layers, some experts none
at all, and its expert split's prefill was predicted 23-39% fast evenly, 11-25% with the
counts (three runs). Trained routers balance better, not evenly, and by the traffic.

Counts halve once a layer holds HALF_ROUTES, so old traffic fades.
"""

from __future__ import annotations

import numpy as np

from distributed.step_work import PlanWork

HALF_ROUTES = 2**20  # a layer's counted routes past which every count halves
# routes counted before the model first takes the shares; then as many again as it had
# taken, up to the most: each refresh empties the model's predictions, and each costs up
# to tens of milliseconds to make again (a decode step's sampled routes)
FIRST_REFRESH_ROUTES = 2**16
MOST_REFRESH_ROUTES = 2**24
# mlx-lm's SwitchGLU sorts a forward's routes by expert from this many (switch_layers.py);
# below, gather_mm reads each route's expert for it alone.
SORTED_ROUTES = 64


class ExpertLoad:
    """Routes counted per MoE layer and expert, on rank 0."""

    def __init__(self, num_experts: int) -> None:
        self.num_experts = num_experts
        self.counts: dict[int, np.ndarray] = {}  # MoE layer (in order) -> routes per expert
        self.totals: dict[int, float] = {}  # what each layer's counts add up to
        self.seen = 0  # routes counted in all, never halved

    def record(self, layer: int, routes: np.ndarray) -> None:
        """A forward's routes through MoE layer `layer`: every token's chosen experts (a
        router's indices, 0 to num_experts - 1). It runs in every step of an expert split,
        beside the routing's own sync: 1.8 us a layer for 64 routes of 128 experts here."""
        counts = self.counts.get(layer)
        if counts is None:
            counts = self.counts[layer] = np.zeros(self.num_experts, dtype=np.float64)
        counts += np.bincount(routes.reshape(-1), minlength=self.num_experts)[: self.num_experts]
        total = self.totals.get(layer, 0.0) + routes.size
        self.seen += routes.size
        if total > HALF_ROUTES:
            counts /= 2
            total /= 2
        self.totals[layer] = total

    def due(self, taken: int) -> bool:
        """Whether the model, which took the shares when `taken` routes were counted,
        should take them again."""
        wait = min(max(FIRST_REFRESH_ROUTES, taken), MOST_REFRESH_ROUTES)
        return self.seen >= taken + wait

    def shares(self) -> tuple[tuple[float, ...], ...]:
        """Each counted layer's routes per expert as shares of its routes (each sums to 1)."""
        out = []
        for layer in sorted(self.counts):
            counts = self.counts[layer]
            total = counts.sum()
            if total > 0:
                out.append(tuple(float(c) for c in counts / total))
        return tuple(out)


def busiest_share(shares: tuple[tuple[float, ...], ...], held: list[int]) -> float:
    """The busiest rank's share of a layer's routes, averaged over the layers, where rank r
    holds `held[r]` experts in order (an expert split); without counts, every expert as
    popular as the next."""
    if not shares:
        return max(held) / max(1, sum(held))
    edges = np.cumsum([0, *held])
    per_layer = [
        max(sum(layer[a:b]) for a, b in zip(edges[:-1], edges[1:], strict=True)) for layer in shares
    ]
    return float(np.mean(per_layer))


def touched(held: int, total: int, picks: int, tokens: int) -> float:
    """Expected distinct experts among `held` of `total` that `tokens` tokens touch, each
    token routing to `picks` different experts, uniformly (no routing statistics)."""
    if not held or not tokens or not total:
        return 0.0
    return held * (1 - (1 - picks / total) ** tokens)


def routed_reads(work: PlanWork, tokens: int, samples: int = 256) -> list[tuple[float, float]]:
    """Per rank, (expert reads in a MoE layer, its share of the layer's routes) for a
    forward of `tokens` tokens. Under SORTED_ROUTES routes mlx-lm's SwitchGLU does not sort
    them, and each route reads its expert; past it, each expert touched is read once for
    its tokens. A rank of a pipeline or of mlx-lm's shard() computes every route (through
    its slice of each expert in the latter). An expert split's ranks wait at each layer's
    all_sum for the busiest, so each counts the busiest rank's: the most reads and the
    largest share of routes, by the layers' routes as serving counted them
    (`expert_shares`) or evenly."""
    held = [r.experts_held for r in work.ranks]
    total, picks = work.num_experts, work.experts_per_token
    if not total or not any(held) or not tokens:
        return [(0.0, 0.0)] * len(held)
    each_route = tokens * picks < SORTED_ROUTES
    if not (work.strategy == "tensor" and work.experts_divided):
        reads = [tokens * picks if each_route else touched(h, total, picks, tokens) for h in held]
        return [(r, 1.0) if h else (0.0, 0.0) for r, h in zip(reads, held, strict=True)]
    layers = [np.asarray(s) for s in work.expert_shares] or [np.full(total, 1.0 / total)]
    edges = np.cumsum([0, *held])
    spans = list(zip(edges[:-1], edges[1:], strict=True))
    share = busiest_share(work.expert_shares, held)
    many = tokens * picks > 4 * total
    if many and each_route:  # many routes: each rank's expected routes are its reads
        busiest = [max(tokens * picks * p[a:b].sum() for a, b in spans) for p in layers]
    elif many:  # many tokens: each rank's expected count is its count
        chance = [np.minimum(1.0, picks * p) for p in layers]  # a token's odds of each expert
        busiest = [max((1 - (1 - c[a:b]) ** tokens).sum() for a, b in spans) for c in chance]
    else:  # few: E[max over ranks] by a seeded sampling of routes, `picks` per token,
        # over 8 of the layers at most (a decode step's prediction stays milliseconds)
        rng = np.random.default_rng(0)
        sampled = layers[:: max(1, len(layers) // 8)][:8]
        each = samples // len(sampled)
        busiest = []
        for p in sampled:
            with np.errstate(divide="ignore"):
                keys = np.log(p) + rng.gumbel(size=(each, tokens, total))
            chosen = np.argpartition(-keys, picks - 1, axis=-1)[..., :picks].reshape(each, -1)
            routes = np.stack([np.bincount(c, minlength=total) for c in chosen])
            read = routes if each_route else routes > 0
            counts = np.stack([read[:, a:b].sum(axis=1) for a, b in spans], axis=1)
            busiest.append(float(counts.max(axis=1).mean()))
    most = float(np.mean(busiest))
    return [(most, share) if h else (0.0, 0.0) for h in held]
