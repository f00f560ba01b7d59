"""Dividing countable units (heads, experts, columns, layers, vocabulary rows) among ranks.

`apportion` follows the rank weights by the largest-remainder method, at least one unit per
rank. `balance` weighs the fine-grained units (MLP columns, vocabulary rows) so that each
rank's whole share of parameters follows its weight, although the coarse units (whole KV
heads, whole experts) cannot: SmolLM2's 3 KV heads over 2 equal ranks put 2/3 of the
attention on rank 0, and giving rank 0 fewer MLP columns and vocabulary rows evens that out.
"""

from __future__ import annotations

import math

Span = tuple[int, int]


def apportion(total: int, weights: list[float]) -> list[int]:
    """Split `total` units by weight: largest remainder, then at least one unit per rank."""
    if total < len(weights):
        raise ValueError(f"cannot give {len(weights)} ranks at least one of {total} units")
    scale = total / sum(weights)
    ideal = [w * scale for w in weights]
    shares = [math.floor(x) for x in ideal]
    by_remainder = sorted(range(len(weights)), key=lambda i: (-(ideal[i] - shares[i]), i))
    for i in by_remainder[: total - sum(shares)]:
        shares[i] += 1
    for i in range(len(shares)):
        if shares[i] == 0:
            donor = max(
                (j for j in range(len(shares)) if shares[j] > 1),
                key=lambda j: (shares[j] - ideal[j], -j),
            )
            shares[donor] -= 1
            shares[i] = 1
    return shares


def spans(shares: list[int], unit: int = 1) -> list[Span]:
    """Contiguous [start, end) ranges of the given sizes (in units of `unit`)."""
    out, start = [], 0
    for share in shares:
        out.append((start * unit, (start + share) * unit))
        start += share
    return out


def split(total: int, weights: list[float], unit: int = 1) -> list[Span]:
    """`total` (a multiple of `unit`) in contiguous ranges of whole units, by weight."""
    return spans(apportion(total // unit, weights), unit)


def balance(weights: list[float], fixed: list[float], fine_total: float) -> list[float]:
    """Weights for the fine units so that fixed + fine follows `weights` on every rank.

    `fixed[r]` is what rank r holds regardless (replicated parts, its whole heads and
    experts); `fine_total` what the fine units add up to. Each rank's target is its weighted
    share of everything the ranks hold together; a rank whose fixed part already exceeds
    its target still gets a token of fine units (every rank keeps at least one).
    """
    held = sum(fixed) + fine_total
    total_weight = sum(weights)
    floor = max(held, 1.0) * 1e-9
    return [max(w / total_weight * held - f, floor) for w, f in zip(weights, fixed, strict=True)]
