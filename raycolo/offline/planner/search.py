"""The stage loop every offline policy shares, and the building blocks policies use.

A policy is a function ``choose(ctx, state) -> StageEval``: given the state after the
previous stage, pick the next stage. :func:`run_policy` repeats that until every node has
finished and records the stages as an :class:`AppPlan`.
"""
from __future__ import annotations

import time
from typing import Callable, Optional

from raycolo.errors import PlanningError
from raycolo.offline.planner.lower_bounds import lower_bound
from raycolo.offline.planner.engines import switch_kind
from raycolo.offline.planner.problem import ExecPlan, PlanningProblem
from raycolo.offline.planner.schedule import AppPlan, PlanStage, PlannedModel
from raycolo.offline.planner.state import AppState, StageEval, StageEvaluator, initial_state

GAIN_EPSILON = 1e-12
STAGE_METRICS = {
    "window": lambda ev: ev.throughput,   # FLOPs within the stage / stage duration (paper)
    "rate": lambda ev: ev.run_rate,       # each node's whole-run FLOP rate, load amortized
}


class SearchContext:
    def __init__(self, problem: PlanningProblem, evaluator: Optional[StageEvaluator] = None,
                 metric: str = "window"):
        self.problem = problem
        self.evaluator = evaluator or StageEvaluator(problem)
        self.metric = STAGE_METRICS[metric]

    def ready_nodes(self, state: AppState, selection: dict[str, ExecPlan],
                    transitive: bool = False) -> list[str]:
        """Unfinished nodes whose inputs are finished or run in the same stage.

        With ``transitive``, nodes found ready count as running too, so a whole pipeline
        of unfinished nodes can start together (the ``min`` heuristic does this).
        """
        out: list[str] = []
        for node in self.problem.nodes:
            if state.nodes[node].finished:
                continue
            if all(state.nodes[up].finished or up in selection or (transitive and up in out)
                   for up in self.problem.upstream[node]):
                out.append(node)
        return out

    def evaluate(self, state: AppState, selection: dict[str, ExecPlan],
                 exact: Optional[bool] = None) -> Optional[StageEval]:
        return self.evaluator.evaluate(state, selection, exact)


Chooser = Callable[[SearchContext, AppState], Optional[StageEval]]


def greedy_step(ctx: SearchContext, state: AppState, current: Optional[StageEval],
                frozen: frozenset = frozenset()) -> Optional[StageEval]:
    """The candidate that raises stage throughput the most per extra GPU, if any does."""
    gpus_total = ctx.problem.cluster.num_gpus
    selection = current.selection if current else {}
    used = current.gpus if current else 0
    metric = ctx.metric
    base = metric(current) if current else 0.0
    best, best_gain = None, GAIN_EPSILON
    for node in ctx.ready_nodes(state, selection):
        if node in frozen:
            continue
        have = selection[node].gpus if node in selection else 0
        for plan in ctx.problem.plans[node]:
            if plan.gpus <= have or used - have + plan.gpus > gpus_total:
                continue
            ev = ctx.evaluate(state, {**selection, node: plan})
            if ev is None:
                continue
            gain = (metric(ev) - base) / (ev.gpus - used)
            if gain > best_gain:
                best, best_gain = ev, gain
    return best


def greedy_stage(ctx: SearchContext, state: AppState,
                 fixed: Optional[dict[str, ExecPlan]] = None,
                 start: Optional[dict[str, ExecPlan]] = None) -> Optional[StageEval]:
    """SamuLLM Algorithm 1 for one stage (after Optimus).

    Repeatedly add the (node, plan) whose addition raises the stage throughput (FLOPs
    done before the stage's first finish, per second) the most per extra GPU; a node
    already chosen may be replaced by a plan with more GPUs. Stop when no candidate
    raises the throughput. Nodes in ``fixed`` keep their plan; ``start`` seeds the stage.
    """
    selection = {**(fixed or {}), **(start or {})}
    current = ctx.evaluate(state, selection) if selection else None
    frozen = frozenset(fixed or ())
    while True:
        nxt = greedy_step(ctx, state, current, frozen)
        if nxt is None:
            return current
        current = nxt


def stage_record(problem: PlanningProblem, state: AppState, ev: StageEval, after: AppState) -> PlanStage:
    models = []
    for node in problem.nodes:
        if node not in ev.selection:
            continue
        plan, run = ev.selection[node], ev.runs[node]
        replicas = [list(g) for g in ev.placement[node]]
        before, now = state.nodes[node], after.nodes[node]
        switches = [] if run.continuing or problem.load_costs is None else [
            switch_kind(state.actors, tuple(g), problem.engine_key(node, plan)) for g in replicas]
        models.append(PlannedModel(
            node=node, model=problem.node(node).model.name, dp=plan.dp, tp=plan.tp,
            gpus=sorted(g for r in replicas for g in r), replica_gpus=replicas,
            load_s=run.load_s, reloaded=not run.continuing, finishes=now.finished,
            requests_done=int(now.done.sum() - before.done.sum()), switches=switches))
    return PlanStage(start_s=state.time, end_s=after.time, models=models)


def run_policy(problem: PlanningProblem, name: str, choose: Chooser,
               ctx: Optional[SearchContext] = None) -> AppPlan:
    ctx = ctx or SearchContext(problem)
    started = time.perf_counter()
    state = initial_state(problem)
    stages = []
    max_stages = 4 * len(problem.nodes) + sum(len(w) for w in problem.workload.nodes.values())
    while not state.finished:
        ev = choose(ctx, state)
        if ev is None:
            raise PlanningError(f"policy '{name}' found no runnable stage at t={state.time:.1f}s "
                                f"(unfinished: {', '.join(state.unfinished())})")
        ev = ctx.evaluator.make_exact(state, ev)
        after = ctx.evaluator.advance(state, ev)
        stages.append(stage_record(problem, state, ev, after))
        state = after
        if len(stages) > max_stages:
            raise PlanningError(f"policy '{name}' did not converge")
    search_s = time.perf_counter() - started
    finish = {n: float(s.finish.max()) for n, s in state.nodes.items()}
    return AppPlan(policy=name, makespan_s=state.time, search_s=search_s,
                   lower_bound_s=lower_bound(problem, ctx.evaluator), stages=stages,
                   node_finish_s=finish, simulations=ctx.evaluator.simulations,
                   gpus=problem.cluster.num_gpus,
                   costed_from=problem.cost_sources((m.model, m.tp) for s in stages for m in s.models))


def fill_idle_gpus(ctx: SearchContext, state: AppState, ev: Optional[StageEval]) -> Optional[StageEval]:
    """Give GPUs the greedy left idle to ready nodes, fastest plan that fits, in order.

    The greedy's first-finish throughput is myopic: a model that must load first adds no
    FLOPs to a short stage, so GPUs idle although the model would pay off later.
    """
    selection = dict(ev.selection) if ev else {}
    free = ctx.problem.cluster.num_gpus - sum(p.gpus for p in selection.values())
    changed = False
    for node in ctx.ready_nodes(state, selection):
        if node in selection:
            continue
        plans = [p for p in ctx.problem.plans[node] if p.gpus <= free]
        if not plans:
            continue
        plan = max(plans, key=lambda p: (p.gpus, -p.tp))
        candidate = ctx.evaluate(state, {**selection, node: plan})
        if candidate is None:
            continue
        selection, ev, free, changed = candidate.selection, candidate, free - plan.gpus, True
    return ev if changed else None


def complete_with(ctx: SearchContext, state: AppState, choose: Chooser,
                  max_stages: int = 10_000) -> tuple[float, list[dict[str, ExecPlan]]]:
    """Run ``choose`` from ``state`` to the end; returns (makespan, stage selections)."""
    selections = []
    while not state.finished and len(selections) < max_stages:
        ev = choose(ctx, state)
        if ev is None:
            return float("inf"), selections
        ev = ctx.evaluator.make_exact(state, ev)
        selections.append(ev.selection)
        state = ctx.evaluator.advance(state, ev)
    return (state.time if state.finished else float("inf")), selections


def replay_selections(selections: list[dict[str, ExecPlan]]) -> Chooser:
    """A chooser that plays back a fixed list of stage selections."""
    it = iter(selections)

    def choose(ctx: SearchContext, state: AppState) -> Optional[StageEval]:
        selection = next(it, None)
        return None if selection is None else ctx.evaluate(state, selection, exact=True)
    return choose
