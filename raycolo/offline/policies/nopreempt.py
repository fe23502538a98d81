"""``samullm-nopreempt``: the greedy, but a started model keeps its plan until it finishes.

This is the paper's no-preemption ablation (§5.5): free GPUs go to new models only.
"""
from raycolo.offline.planner.problem import PlanningProblem
from raycolo.offline.planner.schedule import AppPlan
from raycolo.offline.planner.search import SearchContext, greedy_stage, run_policy
from raycolo.offline.planner.state import AppState
from raycolo.offline.policies.registry import register


def _choose(ctx: SearchContext, state: AppState):
    running = {n: s.loaded for n, s in state.nodes.items() if s.loaded is not None and not s.finished}
    return greedy_stage(ctx, state, fixed=running)


@register("samullm-nopreempt")
def plan(problem: PlanningProblem) -> AppPlan:
    return run_policy(problem, "samullm-nopreempt", _choose)
