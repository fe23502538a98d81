"""Checks that a plan is executable: GPUs, NVLink groups, memory, dependencies, coverage.

Returns a list of human-readable violations (empty: valid). Used by the tests, by
``raycolo plan`` as a guard, and by the runtime before it starts any actor.
"""
from __future__ import annotations

from raycolo.offline.planner.problem import ExecPlan, PlanningProblem
from raycolo.offline.planner.schedule import AppPlan

TIME_TOLERANCE = 1e-6


def plan_violations(problem: PlanningProblem, plan: AppPlan) -> list[str]:
    cluster = problem.cluster
    group_of = {gpu: i for i, grp in enumerate(cluster.nvlink_groups()) for gpu in grp}
    out: list[str] = []
    finished_at: dict[str, float] = {}
    done = {n: 0 for n in problem.nodes}
    previous_end = 0.0
    for i, stage in enumerate(plan.stages):
        where = f"stage {i}"
        if stage.start_s + TIME_TOLERANCE < previous_end or stage.end_s < stage.start_s:
            out.append(f"{where}: times {stage.start_s}-{stage.end_s} overlap or run backwards")
        previous_end = stage.end_s
        used: list[int] = []
        in_stage = {m.node for m in stage.models}
        for m in stage.models:
            plan_ = ExecPlan(m.dp, m.tp)
            if plan_ not in problem.plans[m.node]:
                out.append(f"{where}: {m.node} plan {plan_} is not valid (memory or TP limits)")
            if len(m.replica_gpus) != m.dp or any(len(r) != m.tp for r in m.replica_gpus):
                out.append(f"{where}: {m.node} GPU list does not match dp{m.dp}xtp{m.tp}")
            for replica in m.replica_gpus:
                if len({group_of.get(g, -1) for g in replica}) != 1 or -1 in {group_of.get(g, -1) for g in replica}:
                    out.append(f"{where}: {m.node} replica {replica} spans NVLink groups")
            used.extend(g for r in m.replica_gpus for g in r)
            for up in problem.upstream[m.node]:
                ok = (up in in_stage) or finished_at.get(up, float("inf")) <= stage.start_s + TIME_TOLERANCE
                if not ok:
                    out.append(f"{where}: {m.node} runs before its input {up} finished or runs")
            if finished_at.get(m.node) is not None:
                out.append(f"{where}: {m.node} runs after it finished")
            done[m.node] += m.requests_done
        if len(used) != len(set(used)):
            out.append(f"{where}: a GPU is assigned twice: {sorted(used)}")
        if len(used) > cluster.num_gpus or any(g < 0 or g >= cluster.num_gpus for g in used):
            out.append(f"{where}: uses GPUs {sorted(used)} on a {cluster.num_gpus}-GPU node")
        for m in stage.models:
            if m.finishes:
                finished_at[m.node] = stage.end_s
    for node in problem.nodes:
        total = len(problem.node(node))
        if done[node] != total:
            out.append(f"{node}: {done[node]} of {total} requests served")
        if node not in finished_at:
            out.append(f"{node}: never finishes")
    if plan.stages and abs(plan.stages[-1].end_s - plan.makespan_s) > TIME_TOLERANCE * max(1, plan.makespan_s):
        out.append(f"makespan {plan.makespan_s} differs from the last stage end {plan.stages[-1].end_s}")
    return out
