"""LeMix allocation (§IV-C): task-level node scores and queue-level deprioritization.

* IP = -max(Π/S - (a - a_prev), τ)                       idleness profit, eq. 1
* LC = N(ℓ; μ, σ) of the node's executed lengths          length consistency, eq. 2
* f  = (IP + λ2·LC) / (λ1·R)                              priority, eq. 3

Eq. 3 divides by R so that faster nodes score higher, which holds while the numerator
is positive. With a negative numerator (IP <= -τ makes it the usual case) the quotient
prefers the node with the *larger* R. LeMix's own code computes exactly that quotient and
takes the argmax (``score_rule="quotient"``); with our LC it puts every task on one node
(docs/online.md). The default ``score_rule="monotone"`` uses (IP + λ2·LC)·(λ1·R) there,
which keeps f decreasing in R and increasing in the numerator on both sides of zero.
Where the numerator is positive, both are exactly eq. 3.

Deprioritization (eq. 4): a training task is held back when the next inference task,
placed on the node where it would answer soonest, would still exceed τ_R.
"""
from __future__ import annotations

import math
from typing import Mapping, Optional, Sequence, Union

MIN_SIGMA_TOKENS = 1.0


def idleness_profit(idle: float, stages: int, interarrival: float, tau: float) -> float:
    return -max(idle / stages - interarrival, tau)


def length_consistency(length: int, count: int, mean: float, std: float,
                       shape_scale: Optional[float] = None) -> float:
    """Gaussian density of ``length`` under the node's lengths so far; 0 with fewer than
    two (no spread to measure: a fresh node has no profile to be consistent with).
    ``shape_scale``: the Gaussian's shape exp(-z²/2) times it instead (LC in seconds)."""
    if count < 2:
        return 0.0
    sigma = max(std, MIN_SIGMA_TOKENS)
    shape = math.exp(-((length - mean) ** 2) / (2 * sigma * sigma))
    if shape_scale is not None:
        return shape * shape_scale
    return shape / (sigma * math.sqrt(2 * math.pi))


def priority(ip: float, lc: float, response: float, lambda1: float, lambda2: float,
             rule: str = "monotone") -> float:
    numerator = ip + lambda2 * lc
    scale = lambda1 * max(response, 1e-12)
    if numerator < 0 and rule == "monotone":
        return numerator * scale
    return numerator / scale


def best_node(scores: Union[Sequence[float], Mapping[int, float]]) -> int:
    """Highest score; ties go to the lowest node index (deterministic). ``scores``: one
    per node, or {node: score} for the nodes that may take work."""
    # dict first: the common case, without the slower Mapping ABC check
    items = scores.items() if isinstance(scores, (dict, Mapping)) else enumerate(scores)
    best, best_score = None, None
    for n, score in items:
        if best is None or score > best_score or (score == best_score and n < best):
            best, best_score = n, score
    if best is None:
        raise ValueError("best_node: no scores")
    return best


def violates_slo(node_free_at: Sequence[float], forward_s: Sequence[float], arrival_s: float,
                 slo_s: float) -> bool:
    """Eq. 4: min over nodes of (the node's last planned forward end + the next inference
    task's forward) - its arrival > τ_R."""
    best = min(free + fwd for free, fwd in zip(node_free_at, forward_s))
    return best - arrival_s > slo_s
