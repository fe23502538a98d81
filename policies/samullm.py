"""``samullm``: the paper's greedy stage search (Algorithm 1, adapted from Optimus).

The greedy adds, stage by stage, the (model, plan) with the highest per-GPU throughput
increase. How a reload is charged decides much of its behaviour, so ``samullm`` runs the
greedy with two throughput measures and keeps the plan that finishes first:

* ``window``: the paper's T(S), FLOPs done before the stage's first finish divided by
  the stage duration; a reload costs the FLOPs lost inside the stage;
* ``rate``: each model's FLOPs over its whole remaining run, load included; a reload is
  amortized over everything the model still has to do.

Both greedies are also registered alone (``samullm-window``, ``samullm-rate``). The
first-stage simulations are done once and shared; where a second core exists they are
split over two processes, and then the two greedies run side by side in forked processes
that inherit the cache (set ``RAYCOLO_PLANNER_PROCESSES=1`` to stay in one process).
"""
from __future__ import annotations

import contextlib
import multiprocessing
import os
import time
from typing import Optional

from raycolo.planner.problem import PlanningProblem
from raycolo.planner.schedule import AppPlan
from raycolo.planner.search import SearchContext, greedy_stage, run_policy
from raycolo.planner.state import StageEvaluator, initial_state
from raycolo.policies import register

METRICS = ("window", "rate")
_shared: dict = {}  # what a forked worker inherits


def _first_stage_runs(pairs) -> list:
    """Simulate (node, plan) pairs from the initial state; returns (cache key, run) pairs."""
    problem, evaluator = _shared["problem"], _shared["evaluator"]
    state = initial_state(problem)
    runs = [evaluator.node_run(state, node, plan, False, {}, exact=not evaluator.representative)
            for node, plan in pairs]
    return [(run.key, run) for run in runs]


def _greedy(metric: str) -> AppPlan:
    problem, evaluator = _shared["problem"], _shared["evaluator"]
    plan = run_policy(problem, "samullm", greedy_stage, SearchContext(problem, evaluator, metric))
    plan.simulations = evaluator.simulations
    return plan


def _processes() -> int:
    wanted = int(os.environ.get("RAYCOLO_PLANNER_PROCESSES", "2"))
    can_fork = "fork" in multiprocessing.get_all_start_methods()
    return min(wanted, len(os.sched_getaffinity(0)), len(METRICS)) if can_fork else 1


@contextlib.contextmanager
def _worker():
    """A forked helper process that exits on its own: Pool's own ``with`` terminates it
    with SIGTERM, which a process inheriting Ray's signal handlers reports loudly."""
    pool = multiprocessing.get_context("fork").Pool(1)
    try:
        yield pool
    finally:
        pool.close()
        pool.join()


@register("samullm")
def plan(problem: PlanningProblem, evaluator: Optional[StageEvaluator] = None) -> AppPlan:
    """``evaluator``: reuse (and fill) a caller's simulation cache, e.g. ``samullm-search``'s."""
    started = time.perf_counter()
    evaluator = evaluator or StageEvaluator(problem)
    ctx = SearchContext(problem, evaluator)
    state = initial_state(problem)
    # The first greedy step of both runs: every (node, plan) from the initial state.
    pairs = [(node, plan) for node in ctx.ready_nodes(state, {}) for plan in problem.plans[node]]
    _shared.update(problem=problem, evaluator=evaluator)
    try:
        if _processes() > 1:
            with _worker() as pool:  # half of the first-stage simulations in a second process
                other_half = pool.apply_async(_first_stage_runs, (pairs[1::2],))
                _first_stage_runs(pairs[0::2])  # fills this process's cache
                evaluator.cache.update(other_half.get())
                evaluator.simulations += len(pairs[1::2])
            with _worker() as pool:  # then the two greedies side by side, sharing that cache
                other = pool.apply_async(_greedy, (METRICS[1],))
                plans = [_greedy(METRICS[0]), other.get()]
        else:
            _first_stage_runs(pairs)
            plans = [_greedy(m) for m in METRICS]
    finally:
        _shared.clear()
    best = min(plans, key=lambda p: p.makespan_s)  # a tie keeps the paper's window metric
    best.search_s = time.perf_counter() - started
    best.simulations = sum(p.simulations for p in plans)
    best.notes.append(f"greedy metric: {METRICS[plans.index(best)]} "
                      f"(window {plans[0].makespan_s:.1f}s, rate {plans[1].makespan_s:.1f}s)")
    return best


@register("samullm-window")
def plan_window(problem: PlanningProblem) -> AppPlan:
    return run_policy(problem, "samullm-window", greedy_stage, SearchContext(problem))


@register("samullm-rate")
def plan_rate(problem: PlanningProblem) -> AppPlan:
    return run_policy(problem, "samullm-rate", greedy_stage, SearchContext(problem, metric="rate"))
