"""A lower bound on the makespan under the same cost model.

* Work: every node must run all of its requests once; at its best per-GPU throughput
  (fewest GPU-seconds, load included, over its valid plans) the total GPU-seconds,
  spread over all GPUs, take at least ``sum / num_gpus`` seconds.
* Critical path: a node cannot finish sooner than its fastest plan allows, and a node
  cannot finish before its slowest upstream node has finished.

The bound ignores the gains a stage could get from running only the dense part of a
workload, so it is an estimate, not a proof; the compare table shows each plan's gap.
"""
from __future__ import annotations

import numpy as np

from raycolo.planner.problem import PlanningProblem
from raycolo.planner.state import StageEvaluator, initial_state, run_node


def node_standalone_runs(problem: PlanningProblem, evaluator: StageEvaluator) -> dict:
    """Each node, each plan, all inputs ready at time 0, from the initial state."""
    state = initial_state(problem)
    out = {}
    for node in problem.nodes:
        zeros = {up: np.zeros(len(problem.node(up))) for up in problem.upstream[node]}
        for plan in problem.plans[node]:
            if not problem.upstream[node]:  # same as the search's first-stage simulation
                out[node, plan] = evaluator.node_run(state, node, plan, False, {},
                                                     exact=not evaluator.representative)
                continue
            key = ("standalone", node, plan)
            run = evaluator.cache.get(key)
            if run is None:
                run = run_node(problem, node, state.nodes[node], plan, False, zeros, key,
                               representative=evaluator.representative)
                evaluator.cache[key] = run
                evaluator.simulations += 1
                evaluator.work += len(problem.node(node))
            out[node, plan] = run
    return out


def lower_bound(problem: PlanningProblem, evaluator: StageEvaluator) -> float:
    runs = node_standalone_runs(problem, evaluator)
    gpu_seconds = 0.0
    fastest = {}
    for node in problem.nodes:
        plans = problem.plans[node]
        gpu_seconds += min(runs[node, p].end * p.gpus for p in plans)
        fastest[node] = min(runs[node, p].end for p in plans)
    path = {}
    for node in problem.nodes:  # topological order
        path[node] = max([fastest[node]] + [path[up] for up in problem.upstream[node]])
    return max(gpu_seconds / problem.cluster.num_gpus, max(path.values()))
