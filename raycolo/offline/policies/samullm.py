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

One process does the same computation and counts its work the same way (the other
process's work is not counted in a caller's budget, ``samullm-search``'s), so a plan does
not depend on how many cores the machine has.
"""
from __future__ import annotations

import collections
import contextlib
import gc
import multiprocessing
import os
import time
from typing import Callable, Optional

from raycolo.offline.planner.problem import PlanningProblem
from raycolo.offline.planner.schedule import AppPlan
from raycolo.offline.planner.search import SearchContext, greedy_stage, run_policy
from raycolo.offline.planner.state import StageEvaluator, initial_state
from raycolo.offline.policies.registry import register

METRICS = ("window", "rate")
_shared: dict = {}  # what a forked worker inherits


def _first_stage_runs(pairs) -> list:
    """Simulate (node, plan) pairs from the initial state; returns (cache key, run) pairs."""
    problem, evaluator = _shared["problem"], _shared["evaluator"]
    state = initial_state(problem)
    runs = [evaluator.node_run(state, node, plan, False, {}, exact=not evaluator.representative)
            for node, plan in pairs]
    return [(run.key, run) for run in runs]


def _split(pairs: list, evaluator: StageEvaluator) -> tuple[list, list]:
    """Share the first-stage pairs out over two processes, simulated requests balanced.

    This process keeps as many pairs of each node as every other pair would give it: its
    share is what its evaluator counts as work, so budgets stay as they were. Largest
    first (an estimate simulates one of the dp replicas), each pair goes to the process
    with fewer requests so far, unless the node's count for it is used up.
    """
    problem = evaluator.problem
    left = {0: collections.Counter(node for node, _ in pairs[0::2]),
            1: collections.Counter(node for node, _ in pairs[1::2])}
    shares: tuple[list, list] = ([], [])
    load = [0.0, 0.0]

    def requests(i: int) -> float:
        node, plan = pairs[i]
        estimate = evaluator.estimates(node, plan, False, exact=not evaluator.representative)
        return len(problem.node(node)) / (plan.dp if estimate else 1)

    for i in sorted(range(len(pairs)), key=lambda i: (-requests(i), i)):
        node = pairs[i][0]
        side = 0 if load[0] <= load[1] else 1
        if not left[side][node]:
            side = 1 - side
        left[side][node] -= 1
        load[side] += requests(i)
        shares[side].append(i)
    return tuple([pairs[i] for i in sorted(share)] for share in shares)


def _greedy(metric: str) -> AppPlan:
    problem, evaluator = _shared["problem"], _shared["evaluator"]
    plan = run_policy(problem, "samullm", greedy_stage, SearchContext(problem, evaluator, metric))
    plan.simulations = evaluator.simulations
    return plan


def _processes() -> int:
    wanted = int(os.environ.get("RAYCOLO_PLANNER_PROCESSES", "2"))
    can_fork = "fork" in multiprocessing.get_all_start_methods()
    return min(wanted, len(os.sched_getaffinity(0)), len(METRICS)) if can_fork else 1


def _child_main(fn: Callable, args: tuple, send) -> None:
    try:
        result = (True, fn(*args))
    except BaseException as exc:  # raised again in the parent
        result = (False, exc)
    try:
        send.send(result)
    except OSError:
        pass                       # the parent stopped waiting
    except Exception as exc:       # a result that does not pickle
        send.send((False, RuntimeError(f"{getattr(fn, '__name__', fn)} in a child process: {exc!r}")))
    finally:
        send.close()


@contextlib.contextmanager
def _in_child(fn: Callable, *args):
    """``fn(*args)`` in a forked process; yields a function that waits for its result.

    A plain process that exits on its own (a Pool's ``with`` ends its worker with SIGTERM,
    which a process inheriting Ray's signal handlers reports loudly), and one whose result
    is read when asked for: a Pool's result thread takes it in while this process still
    computes, and for a large result (first-stage runs) the two threads trading the GIL
    can double this process's time.

    The child inherits only the forking thread. Garbage the parent left for the cycle
    collector could be collected in the child, and a finalizer there that takes a lock
    another thread of the parent held at the fork (a Ray or gRPC client's, torch's
    allocator's) waits for ever: a planner child once hung so in the test process. So the
    parent's objects are frozen across the fork (``gc.freeze``): the child never collects
    them, and collects only what it makes.
    """
    ctx = multiprocessing.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_child_main, args=(fn, args, send), daemon=True)
    gc.freeze()
    try:
        child.start()
    finally:
        gc.unfreeze()
    send.close()

    def result():
        ok, value = recv.recv()
        if not ok:
            raise value
        return value
    try:
        yield result
    finally:
        recv.close()
        child.join()


@register("samullm")
def plan(problem: PlanningProblem, evaluator: Optional[StageEvaluator] = None,
         meanwhile: Optional[Callable[[], None]] = None) -> AppPlan:
    """``evaluator``: reuse (and fill) a caller's simulation cache, e.g. ``samullm-search``'s;
    ``meanwhile``: the caller's next work with that cache, run in this process while the
    other process finishes its greedy (after both greedies in one process)."""
    started = time.perf_counter()
    evaluator = evaluator or StageEvaluator(problem)
    ctx = SearchContext(problem, evaluator)
    state = initial_state(problem)
    # The first greedy step of both runs: every (node, plan) from the initial state.
    pairs = [(node, plan) for node in ctx.ready_nodes(state, {}) for plan in problem.plans[node]]
    _shared.update(problem=problem, evaluator=evaluator)
    try:
        if _processes() > 1:
            mine, theirs = _split(pairs, evaluator)
            with _in_child(_first_stage_runs, theirs) as other_half:  # half of the first stage
                _first_stage_runs(mine)  # fills this process's cache
                evaluator.cache.update(other_half())
                evaluator.simulations += len(theirs)
            with _in_child(_greedy, METRICS[1]) as other:  # the greedies side by side
                plans = [_greedy(METRICS[0])]
                if meanwhile:
                    meanwhile()
                plans.append(other())
        else:   # the same computation in one process, counted as two processes count it
            mine, theirs = _split(pairs, evaluator)
            _first_stage_runs(mine)
            counted = evaluator.simulations, evaluator.work
            other_half = _first_stage_runs(theirs)   # the child's half: its work is not counted
            evaluator.simulations, evaluator.work = counted
            evaluator.cache.update(other_half)
            evaluator.simulations += len(theirs)
            child = evaluator.fork()                 # what the second greedy's process starts from
            plans = [_greedy(METRICS[0])]
            if meanwhile:
                meanwhile()
            _shared["evaluator"] = child
            plans.append(_greedy(METRICS[1]))
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
