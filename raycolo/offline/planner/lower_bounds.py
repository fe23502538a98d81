"""A lower bound on the makespan under the same cost model.

* Work (area): every node must run all of its requests once and finish within the
  makespan D, so it needs at least its fewest GPU-seconds (load included) over the plans,
  or plans mixed over stages, fast enough for D (the lower convex hull of the plans'
  (seconds, GPU-seconds)); all of it fits in ``num_gpus x D``. The least such D is at
  least the plain ``sum of fewest GPU-seconds / num_gpus``, and tighter when the cheap
  plans are slow. The branch and bound (:mod:`raycolo.offline.planner.branch`) uses the same
  bound from every state.
* Critical path: a node cannot finish sooner than its fastest plan allows, and a node
  cannot finish before its slowest upstream node has finished.

The bound ignores the gains a stage could get from running only the dense part of a
workload, so it is an estimate, not a proof; the compare table shows each plan's gap.
"""
from __future__ import annotations

import math

import numpy as np

from raycolo.offline.planner.problem import PlanningProblem
from raycolo.offline.planner.state import StageEvaluator, initial_state, run_node


def node_standalone_runs(problem: PlanningProblem, evaluator: StageEvaluator) -> dict:
    """Each node, each plan, all inputs ready at time 0, from the initial state."""
    state = initial_state(problem)
    out = {}
    for node in problem.nodes:
        zeros = {up: np.zeros(len(problem.node(up))) for up in problem.upstream[node]}
        for plan in problem.plans[node]:
            if not problem.upstream[node]:  # same as the search's first-stage simulation
                out[node, plan] = evaluator.node_run(state, node, plan, False, {},
                                                     exact=not evaluator.representative,
                                                     load=problem.min_load_seconds(node, plan))
                continue
            key = ("standalone", node, plan)
            run = evaluator.cache.get(key)
            if run is None:
                run = run_node(problem, node, state.nodes[node], plan, False, zeros, key,
                               representative=evaluator.representative,
                               load=problem.min_load_seconds(node, plan))
                evaluator.cache[key] = run
                evaluator.simulations += 1
                evaluator.work += len(problem.node(node))
            out[node, plan] = run
    return out


def lower_bound(problem: PlanningProblem, evaluator: StageEvaluator) -> float:
    runs = node_standalone_runs(problem, evaluator)
    hulls = []
    fastest = {}
    for node in problem.nodes:
        plans = problem.plans[node]
        hulls.append(lower_hull([(runs[node, p].end, runs[node, p].end * p.gpus) for p in plans]))
        fastest[node] = min(runs[node, p].end for p in plans)
    path = {}
    for node in problem.nodes:  # topological order
        path[node] = max([fastest[node]] + [path[up] for up in problem.upstream[node]])
    critical = max(path.values())
    return max(critical, area_bound(hulls, problem.cluster.num_gpus, critical))


def lower_hull(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The least GPU-seconds for each duration, plans mixed over stages: the lower convex
    hull of (seconds, GPU-seconds), from the fastest plan to the cheapest."""
    pts = sorted(set(points))
    hull: list[tuple[float, float]] = []
    for t, a in pts:
        if hull and a >= hull[-1][1]:
            continue  # slower and no cheaper: never useful
        while len(hull) >= 2:
            (t1, a1), (t2, a2) = hull[-2], hull[-1]
            if (a2 - a1) * (t - t1) >= (a - a1) * (t2 - t1):  # hull[-1] above the chord
                hull.pop()
            else:
                break
        hull.append((t, a))
    return hull


def _area_at(hull: list[tuple[float, float]], d: float) -> float:
    if d >= hull[-1][0]:
        return hull[-1][1]
    if d < hull[0][0]:
        return math.inf
    for (t1, a1), (t2, a2) in zip(hull, hull[1:]):
        if d <= t2:
            return a1 + (a2 - a1) * (d - t1) / (t2 - t1)
    return hull[-1][1]


def area_bound(hulls: list, gpus: int, low: float) -> float:
    """The least horizon D at which every node can finish within D using, in all, no more
    GPU-seconds than gpus x D (each node's least GPU-seconds for a duration <= D)."""
    if not hulls:
        return 0.0
    need = lambda d: sum(_area_at(h, d) for h in hulls) - gpus * d  # noqa: E731
    high = max([low] + [h[-1][0] for h in hulls] + [sum(h[-1][1] for h in hulls) / gpus])
    if need(low) <= 0:
        return low
    for _ in range(50):  # need() decreases in d: bisect
        mid = (low + high) / 2
        if need(mid) <= 0:
            high = mid
        else:
            low = mid
    return low
