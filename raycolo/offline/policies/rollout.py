"""``samullm-rollout``: the greedy plus a rollout improvement step (beyond the paper).

The incumbent starts as the best complete plan among the two greedies of ``samullm``
and the paper's ``max`` and ``min`` heuristics, all under the same cost model. Then, at
each stage of the incumbent, try a few alternative stages (the stage with idle GPUs
filled, the stage with one model's plan reshaped on the same GPUs, e.g. dp2 <-> tp2,
and greedy stages whose first pick is a runner-up candidate), complete each
with the greedy, and keep any completion that finishes sooner. The incumbent is only
replaced by a strictly shorter plan, so the result is never worse than ``samullm``,
``max`` or ``min``. A time budget bounds the search; when it runs out the incumbent is
returned.
"""
from __future__ import annotations

import time

from raycolo.offline.planner.problem import ExecPlan, PlanningProblem
from raycolo.offline.planner.schedule import AppPlan
from raycolo.offline.planner.search import (SearchContext, complete_with, fill_idle_gpus, greedy_stage,
                                    replay_selections, run_policy)
from raycolo.offline.planner.state import AppState, StageEval, initial_state
from raycolo.offline.policies.registry import register

RUNNER_UPS = 2
DEFAULT_BUDGET_S = 20.0


def _first_picks(ctx: SearchContext, state: AppState) -> list[StageEval]:
    """Single-(node, plan) stages ranked by throughput per GPU, best first."""
    ranked = []
    for node in ctx.ready_nodes(state, {}):
        for plan in ctx.problem.plans[node]:
            ev = ctx.evaluate(state, {node: plan})
            if ev is not None:
                ranked.append((ev.throughput / ev.gpus, node, plan, ev))
    ranked.sort(key=lambda r: (-r[0], r[1], r[2]))
    return [r[3] for r in ranked]


def _alternatives(ctx: SearchContext, state: AppState, chosen: dict[str, ExecPlan]) -> list[dict]:
    out = []
    filled = fill_idle_gpus(ctx, state, ctx.evaluate(state, chosen))
    if filled is not None:
        out.append(filled.selection)
    for node, plan in chosen.items():  # same GPUs, other shape: dp <-> tp
        for other in ctx.problem.plans[node]:
            if other != plan and other.gpus == plan.gpus:
                out.append({**chosen, node: other})
    for first in _first_picks(ctx, state)[1: 1 + RUNNER_UPS]:
        ev = greedy_stage(ctx, state, start=first.selection)
        if ev is not None:
            out.append(ev.selection)
    return distinct(out, chosen)


def distinct(selections: list, chosen: dict) -> list:
    """``selections`` without repeats and without ``chosen``, in order."""
    unique = []
    for selection in selections:
        if selection != chosen and selection not in unique:
            unique.append(selection)
    return unique


def _seed_plans(ctx: SearchContext, problem: PlanningProblem):
    """Complete plans to start from: both greedies and the paper's two heuristics."""
    from raycolo.offline.policies.heuristics import choose_max, choose_min

    rate_ctx = SearchContext(problem, ctx.evaluator, metric="rate")
    seeds = [complete_with(ctx, initial_state(problem), greedy_stage),
             complete_with(rate_ctx, initial_state(problem), greedy_stage),
             complete_with(ctx, initial_state(problem), choose_min),
             complete_with(ctx, initial_state(problem), choose_max)]
    return min(seeds, key=lambda s: s[0])  # the first (the paper's greedy) wins ties


@register("samullm-rollout")
def plan(problem: PlanningProblem, budget_s: float = DEFAULT_BUDGET_S) -> AppPlan:
    started = time.perf_counter()
    ctx = SearchContext(problem)
    best_time, best = _seed_plans(ctx, problem)
    state, position = initial_state(problem), 0
    while position < len(best) and time.perf_counter() - started < budget_s:
        for alt in _alternatives(ctx, state, best[position]):
            if time.perf_counter() - started >= budget_s:
                break
            ev = ctx.evaluate(state, alt, exact=True)
            if ev is None:
                continue
            after = ctx.evaluator.advance(state, ev)
            tail_time, tail = complete_with(ctx, after, greedy_stage)
            if tail_time < best_time - 1e-9:
                best_time, best = tail_time, best[:position] + [alt] + tail
        ev = ctx.evaluate(state, best[position], exact=True)
        state = ctx.evaluator.advance(state, ev)
        position += 1
    result = run_policy(problem, "samullm-rollout", replay_selections(best), ctx)
    result.search_s = time.perf_counter() - started
    return result
