"""``samullm``: the paper's greedy stage search (Algorithm 1, adapted from Optimus)."""
from raycolo.planner.problem import PlanningProblem
from raycolo.planner.schedule import AppPlan
from raycolo.planner.search import greedy_stage, run_policy
from raycolo.policies import register


@register("samullm")
def plan(problem: PlanningProblem) -> AppPlan:
    return run_policy(problem, "samullm", greedy_stage)
