"""What makes planning faster must not change a plan: the evaluator's content memo (a state
reached again answers like a fresh evaluator, and counts the same work), the placement
memo, and samullm's split over two processes."""
from __future__ import annotations

import collections
import math

import numpy as np
import pytest

from raycolo.offline.dag import parse_app
from raycolo.hardware import make_cluster
from raycolo.offline.planner.branch import all_selections
from raycolo.offline.planner.placement import place
from raycolo.offline.planner.problem import ExecPlan, PlanningProblem
from raycolo.offline.planner.search import SearchContext
from raycolo.offline.planner.state import StageEvaluator, initial_state, run_node
from raycolo.offline.policies import get_policy
from raycolo.offline.policies.samullm import _in_child, _split
from raycolo.offline.workload import build_workload
from tests.offline.test_planner_search import FUSER as SEARCH_FUSER

# two answers and a model reading both (runs depend on runs upstream in the stage), larger
FUSER = {**SEARCH_FUSER, "name": "memo-fuser",
         "requests": {"count": 140, "input_tokens": {"distribution": "uniform", "min": 5, "max": 80}}}


class Unshared(StageEvaluator):
    """The reference: every node run simulated, none shared by content."""

    def simulate(self, node, st, plan, continuing, upstream, key, estimate=False, stop_at=math.inf,
                 load=None):
        return run_node(self.problem, node, st, plan, continuing, upstream[0], key,
                        stop_at=stop_at, representative=estimate, load=load)


def fuser_problem() -> PlanningProblem:
    return PlanningProblem(build_workload(parse_app(FUSER), seed=3), make_cluster(4, "80GiB", 2))


def walk(evaluator: StageEvaluator, selections: list) -> object:
    state = initial_state(evaluator.problem)
    for selection in selections:
        state = evaluator.advance(state, evaluator.evaluate(state, selection, exact=True))
    return state


def evaluations(ctx: SearchContext, state) -> list:
    """Every stage that may start at ``state``, estimated and exact."""
    return [ctx.evaluate(state, selection, exact=exact)
            for selection in all_selections(ctx, state) for exact in (False, True)]


def assert_same_answers(got: list, reference: list) -> None:
    assert len(got) == len(reference) > 0
    for ev, ref in zip(got, reference):
        assert (ev is None) == (ref is None)
        if ev is None:
            continue
        assert ev.selection == ref.selection and ev.moved == ref.moved
        assert ev.placement == ref.placement
        assert ev.duration == ref.duration and ev.useful_flops == ref.useful_flops
        for node, run in ev.runs.items():
            assert np.array_equal(run.finish, ref.runs[node].finish) and run.end == ref.runs[node].end
            assert run.replica_weight == ref.runs[node].replica_weight


def test_states_reached_again_answer_like_a_fresh_evaluator_and_count_the_same():
    problem = fuser_problem()
    plan = get_policy("samullm-window")(problem)
    stages = [{n: ExecPlan(*p) for n, p in s.items()} for s in plan.selections()]
    assert len(stages) >= 3

    memo = StageEvaluator(problem)  # one evaluator sees every state twice
    ctx = SearchContext(problem, memo)

    def visit(prefix: int) -> tuple:
        before = (memo.simulations, memo.work)
        state = walk(memo, stages[:prefix])  # new node state versions every time
        answers = evaluations(ctx, state)
        return state, answers, (memo.simulations - before[0], memo.work - before[1])

    first = [visit(prefix)[2] for prefix in range(len(stages))]
    simulated = memo.simulated
    for prefix in range(1, len(stages)):
        state, answers, counted = visit(prefix)  # equal content: every run from the memo
        # counted as the first time: a search's budget is spent exactly as without the memo
        assert counted == first[prefix] != (0, 0)

        fresh = Unshared(problem)
        reference_state = walk(fresh, stages[:prefix])
        assert state.time == reference_state.time
        assert_same_answers(answers, evaluations(SearchContext(problem, fresh), reference_state))
        for ev in answers:
            if ev is not None:
                assert ev.placement == place(problem.cluster, ev.selection, state.previous_placement())[0]
    assert memo.simulated == simulated  # stops included


def test_continuing_runs_are_told_apart_by_what_is_left_of_the_load():
    """Two states with the same progress (a big model still loading, nothing generated)
    but less of the load left in one: its continuing runs differ, and so do the memo's."""
    app = {"name": "loading",
           "requests": {"count": 20, "input_tokens": {"distribution": "uniform", "min": 5, "max": 40}},
           "nodes": [{"name": "big", "model": "vicuna-13b-v1.5", "max_output_tokens": 64},
                     {"name": "small", "model": "chatglm3-6b", "max_output_tokens": 16}],
           "edges": [{"from": "input", "to": "big"}, {"from": "input", "to": "small"}]}
    problem = PlanningProblem(build_workload(parse_app(app), seed=1), make_cluster(4, "80GiB", 2))
    memo = StageEvaluator(problem)
    big = {"big": ExecPlan(1, 2)}
    load_left = set()
    for small in (ExecPlan(1, 1), ExecPlan(1, 2)):  # the small model ends the stage first
        first = [{**big, "small": small}]
        state = walk(memo, first)
        assert not state.nodes["big"].generated.any()
        load_left.add(state.nodes["big"].load_left)
        fresh = Unshared(problem)
        got, ref = memo.evaluate(state, big), fresh.evaluate(walk(fresh, first), big)
        assert got.runs["big"].continuing
        assert_same_answers([got], [ref])
    assert len(load_left) == 2


def test_first_stage_split_keeps_this_process_share_of_each_node():
    """The share this process simulates is what its evaluator counts as work: as many pairs
    of each node as every other pair, whichever are chosen for balance."""
    problem = fuser_problem()
    evaluator = StageEvaluator(problem)
    state = initial_state(problem)
    pairs = [(node, plan) for node in SearchContext(problem, evaluator).ready_nodes(state, {})
             for plan in problem.plans[node]]
    mine, theirs = _split(pairs, evaluator)
    assert sorted(mine + theirs) == sorted(pairs)
    assert collections.Counter(n for n, _ in mine) == collections.Counter(n for n, _ in pairs[0::2])
    assert mine == sorted(mine, key=pairs.index) and theirs == sorted(theirs, key=pairs.index)


def test_work_in_a_child_process_comes_back_or_raises():
    with _in_child(np.arange, 2_000_000) as result:  # larger than a pipe holds
        assert np.array_equal(result(), np.arange(2_000_000))
    with pytest.raises(ZeroDivisionError):
        with _in_child(divmod, 1, 0) as result:
            result()
    with _in_child(divmod, 7, 2):
        pass  # never asked for: the child still ends


def test_samullm_plans_the_same_in_one_and_in_two_processes(monkeypatch):
    plans = []
    for processes in ("1", "2"):
        monkeypatch.setenv("RAYCOLO_PLANNER_PROCESSES", processes)
        plan = get_policy("samullm")(fuser_problem())
        plans.append((plan.makespan_s, plan.selections()))
    assert plans[0] == plans[1]


def test_the_default_policy_plans_the_same_on_one_core_as_on_two(monkeypatch):
    """On routing, samullm-search found a 242 s plan with two processes and stopped at the
    greedy's 314 s in one (the other process's work went uncounted only there): the plan
    depended on the machine's core count. One process now counts as two do."""
    from tests.offline.test_planner import problem_for

    plans = []
    for processes in ("1", "2"):
        monkeypatch.setenv("RAYCOLO_PLANNER_PROCESSES", processes)
        plan = get_policy("samullm-search")(problem_for("routing"))
        plans.append((plan.makespan_s, plan.selections(), plan.simulations))
    assert plans[0] == plans[1]
