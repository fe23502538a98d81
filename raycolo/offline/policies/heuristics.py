"""The paper's two competitors (§5).

* ``max``: all GPUs to one model at a time, with that model's highest-throughput plan.
* ``min``: as many models as possible at once, GPUs split as evenly as possible; among
  the even splits, the one with the highest stage throughput (inspired by Saturn's Min).

Both re-plan at every first finish (preemption allowed), like the paper's versions.
"""
from __future__ import annotations

import itertools

from raycolo.offline.planner.problem import ExecPlan, PlanningProblem
from raycolo.offline.planner.schedule import AppPlan
from raycolo.offline.planner.search import SearchContext, run_policy
from raycolo.offline.planner.state import AppState
from raycolo.offline.policies.registry import register

MAX_SPLITS = 64


def _best(evs):
    evs = [e for e in evs if e is not None]
    return max(evs, key=lambda e: e.throughput) if evs else None


def choose_max(ctx: SearchContext, state: AppState):
    ready = [n for n in ctx.ready_nodes(state, {})]
    running = [n for n in ready if state.nodes[n].loaded is not None]
    node = (running or ready)[0]  # finish what is loaded before starting the next model
    plans = [p for p in ctx.problem.plans[node] if p.gpus <= ctx.problem.cluster.num_gpus]
    return _best(ctx.evaluate(state, {node: p}) for p in plans)


def _plan_within(ctx: SearchContext, state: AppState, node: str, share: int):
    """The node's best single-model plan on at most ``share`` GPUs (even split)."""
    plans = [p for p in ctx.problem.plans[node] if p.gpus <= share]
    if not plans:
        return None
    most = max(p.gpus for p in plans)
    runs = [(ctx.evaluate(state, {node: p}), p) for p in plans if p.gpus == most]
    runs = [(e, p) for e, p in runs if e is not None]
    return max(runs, key=lambda item: item[0].throughput)[1] if runs else None


def choose_min(ctx: SearchContext, state: AppState):
    gpus = ctx.problem.cluster.num_gpus
    ready = ctx.ready_nodes(state, {}, transitive=True)
    for k in range(min(len(ready), gpus), 0, -1):
        models = ready[:k]
        base, extra = divmod(gpus, k)
        best = None
        for lucky in itertools.islice(itertools.combinations(range(k), extra), MAX_SPLITS):
            selection: dict[str, ExecPlan] = {}
            for i, node in enumerate(models):
                plan = _plan_within(ctx, state, node, base + (i in lucky))
                if plan is None:
                    break
                selection[node] = plan
            else:
                best = _best([best, ctx.evaluate(state, selection)])
        if best is not None:
            return best
    return None


@register("max")
def plan_max(problem: PlanningProblem) -> AppPlan:
    return run_policy(problem, "max", choose_max)


@register("min")
def plan_min(problem: PlanningProblem) -> AppPlan:
    return run_policy(problem, "min", choose_min)
