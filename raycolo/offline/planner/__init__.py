"""Offline planner core: problem, per-stage evaluation, placement, bounds, replay.

Policies (``raycolo.policies``) decide *which* stages to run; this package answers
*what happens* when a stage runs, so the same code serves search, replay and runtime.
"""
from raycolo.offline.planner.problem import ExecPlan, PlanningProblem
from raycolo.offline.planner.schedule import AppPlan, PlanStage, PlannedModel

__all__ = ["AppPlan", "ExecPlan", "PlanningProblem", "PlanStage", "PlannedModel"]
