"""``optimal``: branch and bound over stage sequences, for small cases.

Every stage is any valid selection of ready nodes and plans (idle GPUs allowed), ended
at its first finish, exactly as the greedy's stages are; so this is the optimum of the
search space the greedy walks, and it measures how far the greedy is from it. The
incumbent starts as the best of the greedy and the heuristics; a branch is cut when its
elapsed time plus the slowest unfinished node's fastest remaining time (load included)
cannot beat the incumbent. Limited to at most 4 nodes and 4 GPUs.
"""
from __future__ import annotations

import itertools
import math
import time

from raycolo.errors import PlanningError
from raycolo.planner.problem import ExecPlan, PlanningProblem
from raycolo.planner.schedule import AppPlan
from raycolo.planner.search import (SearchContext, complete_with, greedy_stage, replay_selections,
                                    run_policy)
from raycolo.planner.state import AppState, StageEvaluator, initial_state
from raycolo.policies import register

MAX_NODES = 4
MAX_GPUS = 4
DEFAULT_TIME_LIMIT_S = 120.0


def optimal_applies(problem: PlanningProblem) -> bool:
    return len(problem.nodes) <= MAX_NODES and problem.cluster.num_gpus <= MAX_GPUS


def _selections(ctx: SearchContext, state: AppState) -> list[dict[str, ExecPlan]]:
    """All non-empty selections of ready nodes (pipelining allowed) within the GPUs."""
    gpus = ctx.problem.cluster.num_gpus
    out = []

    def extend(i: int, chosen: dict[str, ExecPlan], used: int) -> None:
        if i == len(ctx.problem.nodes):
            if chosen:
                out.append(dict(chosen))
            return
        node = ctx.problem.nodes[i]
        extend(i + 1, chosen, used)
        st = state.nodes[node]
        if st.finished or not all(state.nodes[u].finished or u in chosen
                                  for u in ctx.problem.upstream[node]):
            return
        for plan in ctx.problem.plans[node]:
            if used + plan.gpus <= gpus:
                chosen[node] = plan
                extend(i + 1, chosen, used + plan.gpus)
                del chosen[node]

    extend(0, {}, 0)
    return out


def _remaining_bound(ctx: SearchContext, state: AppState) -> float:
    """No node can finish sooner than alone on its fastest plan (inputs all ready)."""
    bound = 0.0
    for node in state.unfinished():
        best = math.inf
        for plan in ctx.problem.plans[node]:
            st = state.nodes[node]
            continuing = st.loaded == plan and st.replicas is not None
            run = ctx.evaluator.node_run(state, node, plan, continuing, {})
            if ctx.problem.upstream[node] and not math.isfinite(run.end):
                best = 0.0  # waits for inputs; the upstream nodes carry the bound
                break
            best = min(best, run.end)
        bound = max(bound, best)
    return bound


@register("optimal")
def plan(problem: PlanningProblem, time_limit_s: float = DEFAULT_TIME_LIMIT_S) -> AppPlan:
    if not optimal_applies(problem):
        raise PlanningError(f"--policy optimal: limited to {MAX_NODES} nodes and {MAX_GPUS} GPUs "
                            f"(this problem has {len(problem.nodes)} nodes, "
                            f"{problem.cluster.num_gpus} GPUs)")
    started = time.perf_counter()
    ctx = SearchContext(problem, StageEvaluator(problem, representative_replicas=False))
    best_time, best = complete_with(ctx, initial_state(problem), greedy_stage)
    explored = itertools.count()
    timed_out = False

    def search(state: AppState, prefix: list) -> None:
        nonlocal best_time, best, timed_out
        if state.finished:
            if state.time < best_time - 1e-9:
                best_time, best = state.time, list(prefix)
            return
        if time.perf_counter() - started > time_limit_s:
            timed_out = True
            return
        if state.time + _remaining_bound(ctx, state) >= best_time - 1e-9:
            return
        children = []
        for selection in _selections(ctx, state):
            ev = ctx.evaluate(state, selection)
            if ev is not None:
                children.append(ev)
        children.sort(key=lambda ev: (-ev.throughput, sorted(ev.selection.items())))
        for ev in children:
            next(explored)
            if state.time + ev.duration >= best_time - 1e-9:
                continue
            search(ctx.evaluator.advance(state, ev), prefix + [ev.selection])

    search(initial_state(problem), [])
    result = run_policy(problem, "optimal", replay_selections(best), ctx)
    result.search_s = time.perf_counter() - started
    result.notes.append(f"explored {next(explored)} stage choices")
    if timed_out:
        result.notes.append(f"time limit {time_limit_s:.0f}s reached: best found, not proven optimal")
    return result
