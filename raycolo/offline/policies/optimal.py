"""``optimal``: branch and bound over stage sequences, the reference for small cases.

Every stage is any valid selection of ready nodes and plans (idle GPUs allowed), ended
at its first finish, exactly as the greedy's stages are; so this is the optimum of the
search space the greedy walks, and it measures how far the greedy is from it. The
incumbent starts as the default policy's plan (``samullm-search``: never worse than the
greedies and the heuristics); the tree search (:mod:`raycolo.offline.planner.branch`) cuts a
branch when its elapsed time plus the critical-path or work bound cannot beat the
incumbent, and a state reached again no earlier (transposition table). Limited to at
most 4 nodes and 4 GPUs.

The plan reports ``proven_optimal`` and, when the time limit stopped the search,
``lower_bound_s`` (the smallest bound over the subtrees left open) and
``optimality_gap`` (makespan / lower bound - 1).
"""
from __future__ import annotations

import time

from raycolo.errors import PlanningError
from raycolo.offline.planner.branch import branch_and_bound
from raycolo.offline.planner.problem import PlanningProblem
from raycolo.offline.planner.schedule import AppPlan
from raycolo.offline.planner.search import SearchContext, replay_selections, run_policy
from raycolo.offline.planner.state import StageEvaluator
from raycolo.offline.policies.registry import register

MAX_NODES = 4
MAX_GPUS = 4
DEFAULT_TIME_LIMIT_S = 120.0


def optimal_applies(problem: PlanningProblem) -> bool:
    return len(problem.nodes) <= MAX_NODES and problem.cluster.num_gpus <= MAX_GPUS


@register("optimal")
def plan(problem: PlanningProblem, time_limit_s: float = DEFAULT_TIME_LIMIT_S) -> AppPlan:
    from raycolo.offline.policies.samullm_search import NAME, _selections_of, finish_bounds
    from raycolo.offline.policies.samullm_search import plan as search_plan

    if not optimal_applies(problem):
        raise PlanningError(f"--policy optimal: limited to {MAX_NODES} nodes and {MAX_GPUS} GPUs "
                            f"(this problem has {len(problem.nodes)} nodes, "
                            f"{problem.cluster.num_gpus} GPUs)")
    started = time.perf_counter()
    seed = search_plan(problem)
    ctx = SearchContext(problem, StageEvaluator(problem, representative_replicas=False))
    deadline = started + time_limit_s
    outcome = branch_and_bound(ctx, seed.makespan_s, _selections_of(seed),
                               stop=lambda: time.perf_counter() >= deadline)
    result = run_policy(problem, "optimal", replay_selections(outcome.best), ctx)
    result.search_s = time.perf_counter() - started
    result.notes.append(f"start: {NAME} {seed.makespan_s:.1f}s; explored {outcome.explored} stages, "
                        f"{outcome.transpositions} transpositions")
    if not outcome.proven:
        result.notes.append(f"time limit {time_limit_s:g}s reached: best found, not proven optimal "
                            f"(lower bound {outcome.lower_bound_s:.1f}s)")
    finish_bounds(result, outcome.proven, outcome.lower_bound_s)
    return result
