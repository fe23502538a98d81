"""``samullm-search``: the default offline policy. The paper's greedy, then a bounded search.

Method (three phases on one simulation cache, under one work budget):

1. **Incumbents.** ``samullm`` (both greedies, exactly the registered policy) and the
   no-preemption greedy always, then ``min`` and ``max`` while the budget lasts, each a
   complete plan under the same cost model. The best is the incumbent; a later phase
   replaces it only by a strictly shorter plan. So the result is never worse than
   ``samullm`` or ``samullm-nopreempt``, nor than ``min``/``max`` once the budget reached
   them (ties keep the paper's greedy).
2. **Large-neighbourhood search over stage sequences** (the ``samullm-rollout`` idea,
   widened). At each stage of the incumbent, try alternative stages: idle GPUs filled,
   one model reshaped on the same GPUs (dp2 <-> tp2), greedy stages seeded with a
   runner-up first pick, the stage with one model left out (it waits), and the stages
   the no-preemption greedy, ``min`` and ``max`` would pick there. Complete each with the
   greedy and with the no-preemption greedy; keep any completion that finishes sooner and
   go on from the changed stage.
3. **Branch and bound** (:mod:`raycolo.offline.planner.branch`, the code ``optimal`` runs) when the
   first stage has few enough selections to enumerate: from the incumbent, with the
   critical-path and area bounds and the transposition table. When it finishes within
   the budget the plan is proven optimal in the stage space (``proven_optimal``);
   otherwise its open subtrees give ``lower_bound_s`` and ``optimality_gap``.

Why this method: the simulator is the cost (over 90 % of planning time), and a stage's
value is only known after simulating the rest of the run, so the search has to spend
its simulations where the greedy's mistakes are. The measured mistakes are structural
(dp vs tp for a latency-bound chain, preempting a model the greedy should have kept,
loading a model too early or too late): the neighbourhood moves of phase 2 target those,
and each costs one greedy completion. On small problems (up to ~4 models on 4 GPUs) the
stage tree is small enough that an exact search with a good incumbent and tight bounds
finishes, or nearly, in a few seconds, and then gives a certificate instead of a guess.
A beam search over stages would need a value for each partial plan, which is the greedy
completion here anyway (so phase 2 is a one-wide pilot method); CP-SAT would need the
makespan as a linear model of the stage choices, which the stop-at-first-finish batching
simulation is not (every stage's duration depends on the whole history).

Budget: deterministic. Work is counted in simulated requests (``StageEvaluator.work``:
the requests of every node run the search asks for, including runs the evaluator's
content memo answers without simulating), and the budget is ``budget_s`` x
``WORK_PER_SECOND`` (calibrated on the 2-core development machine before that memo and
a faster simulator, which spend about half that time now), so the same input gives the
same plan on any machine. The seeds' work counts against it, which leaves the 1,000-request
ensemble nothing beyond ``samullm`` and the no-preemption greedy (+14 % work over
``samullm``'s own process, mostly cached first-stage simulations). A wall-clock guard
(``HARD_LIMIT_FACTOR`` x ``budget_s``) only protects against a very slow or overloaded
machine; if it ends the search, a note says so (and the plan may then differ from run to
run). Default budget (:func:`default_budget_s`): 1 s up to ``LARGE_REQUESTS`` requests in
all (the 1,000-request ensemble, routing), 5 s above (the mixed application, 10,000-request
ensembles), and 3 s where the stage tree is small enough for phase 3 (at most
``MAX_ROOT_SELECTIONS`` first stages: up to ~4 models on up to 4 GPUs, or the 2-model chain
summary on 8 GPUs), where a little more search often ends with a proof.
"""
from __future__ import annotations

import time
from typing import Optional

from raycolo.offline.planner.branch import Bounds, branch_and_bound, count_root_selections
from raycolo.offline.planner.problem import ExecPlan, PlanningProblem
from raycolo.offline.planner.schedule import AppPlan
from raycolo.offline.planner.search import (Chooser, SearchContext, complete_with, greedy_stage,
                                    replay_selections, run_policy)
from raycolo.offline.planner.state import AppState, StageEval, StageEvaluator, initial_state
from raycolo.offline.policies.registry import register
from raycolo.offline.policies.rollout import distinct

NAME = "samullm-search"
WORK_PER_SECOND = 250_000       # simulated requests per second, one core
LARGE_REQUESTS = 10_000
SMALL_BUDGET_S, TREE_BUDGET_S, LARGE_BUDGET_S = 1.0, 3.0, 5.0
HARD_LIMIT_FACTOR = 5.0
MAX_ROOT_SELECTIONS = 400       # phase 3 only where the first stage has at most this many
IMPROVE_EPS = 1e-9


def small_tree(problem: PlanningProblem) -> bool:
    """Whether the first stage has few enough selections for the exhaustive phase."""
    ctx = SearchContext(problem)
    return count_root_selections(ctx, initial_state(problem), MAX_ROOT_SELECTIONS) <= MAX_ROOT_SELECTIONS


def default_budget_s(problem: PlanningProblem) -> float:
    if problem.workload.total_requests > LARGE_REQUESTS:
        return LARGE_BUDGET_S
    return TREE_BUDGET_S if small_tree(problem) else SMALL_BUDGET_S


class Budget:
    """Work (simulated requests) left, plus a wall-clock guard."""

    def __init__(self, evaluators: list[StageEvaluator], budget_s: float, started: float):
        self.evaluators = evaluators
        self.limit = budget_s * WORK_PER_SECOND
        self.deadline = started + HARD_LIMIT_FACTOR * budget_s
        self.wall_hit = False

    @property
    def work(self) -> int:
        return sum(e.work for e in self.evaluators)

    def spent(self) -> bool:
        if self.work >= self.limit:
            return True
        if time.perf_counter() >= self.deadline:
            self.wall_hit = True
            return True
        return False


def _until(choose: Chooser, budget: Budget) -> Chooser:
    """``choose``, but giving up (no stage: the completion counts as infinite) when spent."""
    def wrapped(ctx: SearchContext, state: AppState) -> Optional[StageEval]:
        return None if budget.spent() else choose(ctx, state)
    return wrapped


def _nopreempt(ctx: SearchContext, state: AppState) -> Optional[StageEval]:
    from raycolo.offline.policies.nopreempt import _choose
    return _choose(ctx, state)


def _stage_choosers() -> list[Chooser]:
    from raycolo.offline.policies.heuristics import choose_max, choose_min
    return [_nopreempt, choose_min, choose_max]


def _selections_of(plan: AppPlan) -> list[dict[str, ExecPlan]]:
    return [{node: ExecPlan(dp, tp) for node, (dp, tp) in s.items()} for s in plan.selections()]


def _alternatives(ctx: SearchContext, state: AppState, chosen: dict[str, ExecPlan]) -> list[dict]:
    """Stages to try instead of ``chosen`` at ``state`` (``samullm-rollout``'s and more)."""
    from raycolo.offline.policies.rollout import _alternatives as rollout_alternatives

    out = list(rollout_alternatives(ctx, state, chosen))
    if len(chosen) > 1:  # one model waits (it loads later, or keeps its GPUs for another)
        for node in chosen:
            rest = {n: p for n, p in chosen.items() if n != node}
            if all(state.nodes[u].finished or u in rest for n in rest for u in ctx.problem.upstream[n]):
                out.append(rest)
    for choose in _stage_choosers():
        ev = choose(ctx, state)
        if ev is not None:
            out.append(ev.selection)
    return distinct(out, chosen)


def _improve(ctx: SearchContext, best_time: float, best: list, budget: Budget) -> tuple[float, list, int]:
    """Phase 2: first-improvement neighbourhood search along the incumbent's stages."""
    completions = [_until(greedy_stage, budget), _until(_nopreempt, budget)]
    state, position, improved = initial_state(ctx.problem), 0, 0
    while position < len(best) and not budget.spent():
        for alt in _alternatives(ctx, state, best[position]):
            if budget.spent():
                break
            ev = ctx.evaluate(state, alt, exact=True)
            if ev is None or state.time + ev.duration >= best_time - IMPROVE_EPS:
                continue
            after = ctx.evaluator.advance(state, ev)
            for complete in completions:
                tail_time, tail = complete_with(ctx, after, complete)
                if tail_time < best_time - IMPROVE_EPS:
                    best_time, best = tail_time, best[:position] + [alt] + tail
                    improved += 1
        ev = ctx.evaluate(state, best[position], exact=True)
        state = ctx.evaluator.advance(state, ev)
        position += 1
    return best_time, best, improved


@register(NAME)
def plan(problem: PlanningProblem, budget_s: Optional[float] = None,
         exhaustive: bool = True) -> AppPlan:
    """``budget_s``: the search's budget beyond nothing (default :func:`default_budget_s`);
    ``exhaustive``: allow phase 3 on small problems."""
    from raycolo.offline.policies.samullm import plan as samullm_plan

    started = time.perf_counter()
    budget_s = default_budget_s(problem) if budget_s is None else budget_s
    evaluator = StageEvaluator(problem)
    exact = StageEvaluator(problem, representative_replicas=False)
    exact.cache = evaluator.cache  # keys tell estimates from exact runs apart
    budget = Budget([evaluator, exact], budget_s, started)
    ctx = SearchContext(problem, evaluator)
    notes = []

    # Phase 1: incumbents. samullm and its no-preemption variant always run in full (the
    # two that win on the paper's applications); min and max while the budget lasts. All
    # but samullm run while samullm's second greedy finishes in another process.
    others = []

    def other_incumbents() -> None:
        for name, choose in zip(("samullm-nopreempt", "min", "max"), _stage_choosers()):
            if name != "samullm-nopreempt":
                choose = _until(choose, budget)
            others.append((name, *complete_with(ctx, initial_state(problem), choose)))

    greedy = samullm_plan(problem, evaluator=evaluator, meanwhile=other_incumbents)
    best_time, best, source = greedy.makespan_s, _selections_of(greedy), "samullm"
    for name, t, selections in others:
        if t < best_time - IMPROVE_EPS:
            best_time, best, source = t, selections, name
    notes.append(f"best start: {source} ({greedy.makespan_s:.1f}s from samullm)")

    # Phase 2: neighbourhood search.
    best_time, best, improved = _improve(ctx, best_time, best, budget)
    if improved:
        notes.append(f"neighbourhood search: {improved} improvements")

    # Phase 3: branch and bound where the stage tree is small.
    proven, bound = False, 0.0
    exact_ctx = SearchContext(problem, exact)
    if exhaustive and not budget.spent() and small_tree(problem):
        outcome = branch_and_bound(exact_ctx, best_time, best, budget.spent, bounds=Bounds(exact_ctx))
        if outcome.best_time < best_time - IMPROVE_EPS:
            notes.append(f"branch and bound: {best_time:.1f}s -> {outcome.best_time:.1f}s")
            best_time, best = outcome.best_time, outcome.best
        proven, bound = outcome.proven, outcome.lower_bound_s
        notes.append(f"branch and bound: {'proven optimal' if proven else 'stopped'} after "
                     f"{outcome.explored} stages, {outcome.transpositions} transpositions, "
                     f"gap {outcome.gap:.1%}")
    if budget.wall_hit:
        notes.append(f"wall-clock guard ({HARD_LIMIT_FACTOR:.0f} x {budget_s:g}s) ended the search")

    result = run_policy(problem, NAME, replay_selections(best), ctx)
    result.search_s = time.perf_counter() - started
    result.simulations = evaluator.simulations + exact.simulations
    result.notes.extend(notes)
    finish_bounds(result, proven, bound)
    return result


def finish_bounds(result: AppPlan, proven: bool, search_bound: float) -> None:
    """Set ``proven_optimal``, ``lower_bound_s`` and ``optimality_gap`` from a tree search."""
    if proven:
        result.proven_optimal = True
        result.lower_bound_s = result.makespan_s
    elif search_bound > 0:
        result.lower_bound_s = min(result.makespan_s, max(result.lower_bound_s, search_bound))
    else:
        return
    result.optimality_gap = max(0.0, result.makespan_s / result.lower_bound_s - 1)
