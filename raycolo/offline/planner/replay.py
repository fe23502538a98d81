"""Executing a plan when reality departs from it: SamuLLM's dynamic stage adjustment (§4.3).

A plan is a list of stages. At run time the stage boundaries are whatever model finishes
first *in reality*. :class:`StageAdjuster` decides, at each such finish, what runs next:

1. A running model keeps running if no later stage mentions it, or if the next stage that
   mentions it uses the same plan (that is the same as scheduling it from that stage).
2. Then the pairs of the earliest stage not yet fully scheduled are placed, in order, while
   GPUs are free and their inputs are finished or running; the next stage is only
   considered once every pair of this one is scheduled or finished, and never beyond the
   stage that corresponds to the current boundary (the n-th finish opens stage n).
3. A running model whose next planned plan differs keeps its current plan if GPUs are
   still free; otherwise it is preempted and waits for its own stage.

Placement then keeps models on their GPUs where possible (fewest reloads). The same
adjuster drives :func:`replay` in the simulator and, later, the Ray controller.
"""
from __future__ import annotations

from typing import Optional

from raycolo.errors import PlanningError
from raycolo.offline.planner.problem import ExecPlan, PlanningProblem
from raycolo.offline.planner.schedule import AppPlan
from raycolo.offline.planner.search import stage_record
from raycolo.offline.planner.state import AppState, StageEvaluator, initial_state


class StageAdjuster:
    def __init__(self, problem: PlanningProblem, stages: list[dict[str, ExecPlan]]):
        self.problem = problem
        self.stages = stages
        self.pointer = 0     # earliest stage not yet fully scheduled
        self.decisions = 0   # stage boundaries seen so far (finishes, in reality)

    def _next_plan(self, node: str, start: int) -> Optional[ExecPlan]:
        for stage in self.stages[start:]:
            if node in stage:
                return stage[node]
        return None

    def _inputs_ready(self, state: AppState, node: str, chosen: dict[str, ExecPlan]) -> bool:
        return all(state.nodes[u].finished or u in chosen for u in self.problem.upstream[node])

    def next_selection(self, state: AppState, running: dict[str, ExecPlan]) -> dict[str, ExecPlan]:
        gpus = self.problem.cluster.num_gpus
        running = {n: p for n, p in running.items() if not state.nodes[n].finished}
        chosen: dict[str, ExecPlan] = {}
        deferred: dict[str, ExecPlan] = {}
        for node, plan in running.items():  # rule 1
            nxt = self._next_plan(node, self.pointer)
            if nxt is None or nxt == plan:
                chosen[node] = plan
            else:
                deferred[node] = plan
        used = sum(p.gpus for p in chosen.values())
        k = self.pointer
        # rule 2; never past the stage this boundary corresponds to, so a later stage that
        # happens to match what is running is not taken as already begun
        while k < len(self.stages) and k <= self.decisions:
            complete = True
            for node, plan in self.stages[k].items():
                if state.nodes[node].finished or chosen.get(node) == plan:
                    continue
                if node in chosen:  # still running its previous stage's plan
                    complete = False
                    break
                if used + plan.gpus > gpus or not self._inputs_ready(state, node, chosen):
                    complete = False
                    break
                chosen[node] = plan
                deferred.pop(node, None)
                used += plan.gpus
            if not complete:
                break
            k += 1
        self.pointer = k
        self.decisions += 1
        for node, plan in deferred.items():  # rule 3
            if used + plan.gpus <= gpus:
                chosen[node] = plan
                used += plan.gpus
        if not chosen:  # plan exhausted but work remains: run what is ready, last planned plan
            for node in state.unfinished():
                if not self._inputs_ready(state, node, chosen):
                    continue
                plan = self._last_plan(node)
                if used + plan.gpus <= gpus:
                    chosen[node] = plan
                    used += plan.gpus
        return chosen

    def _last_plan(self, node: str) -> ExecPlan:
        for stage in reversed(self.stages):
            if node in stage:
                return stage[node]
        return self.problem.plans[node][0]


def replay(problem: PlanningProblem, plan: AppPlan, name: Optional[str] = None) -> AppPlan:
    """Execute ``plan``'s stages on ``problem`` (e.g. other output lengths) with adjustment."""
    stages = [{n: ExecPlan(dp, tp) for n, (dp, tp) in s.items()} for s in plan.selections()]
    adjuster = StageAdjuster(problem, stages)
    evaluator = StageEvaluator(problem, representative_replicas=False)
    state = initial_state(problem)
    running: dict[str, ExecPlan] = {}
    records = []
    limit = 4 * len(problem.nodes) + len(stages) + sum(len(w) for w in problem.workload.nodes.values())
    while not state.finished:
        selection = adjuster.next_selection(state, running)
        ev = evaluator.evaluate(state, selection, exact=True) if selection else None
        if ev is None:
            raise PlanningError(f"replay of '{plan.policy}' is stuck at t={state.time:.1f}s "
                                f"(unfinished: {', '.join(state.unfinished())})")
        after = evaluator.advance(state, ev)
        records.append(stage_record(problem, state, ev, after))
        running = dict(ev.selection)
        state = after
        if len(records) > limit:
            raise PlanningError(f"replay of '{plan.policy}' did not converge")
    return AppPlan(policy=name or f"{plan.policy} (replayed)", makespan_s=state.time,
                   search_s=0.0, lower_bound_s=plan.lower_bound_s, stages=records,
                   node_finish_s={n: float(s.finish.max()) for n, s in state.nodes.items()},
                   simulations=evaluator.simulations, gpus=problem.cluster.num_gpus,
                   costed_from=problem.cost_sources((m.model, m.tp) for s in records for m in s.models))
