"""The planner following the runtime's engine actors (raycolo.offline.planner.engines): the rules
of keep / wake / swap / cold, each replica charged by how it gets its engine, and the
exact searches still exact with those charges (against a brute force without bounds or
memo). The runtime's side is tested against real engine actors in test_runtime.py."""
from __future__ import annotations

import math

import pytest

from raycolo.offline.planner.branch import branch_and_bound
from raycolo.offline.planner.engines import HeldEngines, LoadCosts, start, switch_kind
from raycolo.offline.planner.problem import ExecPlan, PlanningProblem
from raycolo.offline.planner.search import SearchContext
from raycolo.offline.planner.state import StageEvaluator, initial_state
from raycolo.offline.policies import get_policy
from tests.offline.test_planner_search import FUSER, TINY, brute_force, problem_of, small_case

A, B, C, D, E = ("a", 1), ("b", 1), ("c", 1), ("d", 2), ("e", 1)


def test_the_engine_actor_rules():
    actors = (HeldEngines((0,), A), HeldEngines((1,), B))
    assert switch_kind(actors, (0,), A) == "keep" and switch_kind(actors, (0,), B) == "swap"
    assert switch_kind(actors, (0, 1), D) == "cold"
    one = start(actors, (0,), C, max_parked=1)                  # a swap parks the old engine
    assert one == (HeldEngines((0,), C, (A,)), HeldEngines((1,), B))
    assert switch_kind(one, (0,), A) == "wake"
    back = start(one, (0,), A, max_parked=1)                    # the wake parks C in A's place
    assert back[0] == HeldEngines((0,), A, (C,))
    assert start(back, (0,), B, max_parked=1)[0] == HeldEngines((0,), B, (A,))   # C released
    two = start(start(actors, (0,), C, max_parked=2), (0,), E, max_parked=2)
    assert two[0] == HeldEngines((0,), E, (A, C))                 # least recently used first
    assert start(two, (0,), B, max_parked=2)[0] == HeldEngines((0,), B, (C, E))
    assert start(actors, (0,), C, max_parked=0)[0] == HeldEngines((0,), C, ())
    assert start(actors, (0,), A, max_parked=1) == actors         # a keep changes nothing
    # a cold start stops every actor on its GPUs, and a tp1 replica on one of them then
    # finds no actor on exactly its GPU: cold again
    wide = start(actors, (0, 1), D, max_parked=1)
    assert wide == (HeldEngines((0, 1), D),)
    assert switch_kind(wide, (0,), A) == "cold"
    assert start(wide, (1,), B, max_parked=1) == (HeldEngines((1,), B),)


COSTS = dict(cold_s=30.0, swap_s=8.0, wake_s=1.5, keep_s=0.1, max_parked=1)


def costed(app: dict, gpus: int, nvlink: int, actors, costs: dict = COSTS) -> PlanningProblem:
    plain = problem_of(app, gpus, nvlink)
    return PlanningProblem(plain.workload, plain.cluster,
                           load_costs=LoadCosts(**costs, actors=tuple(actors)))


def test_each_replica_is_charged_by_how_it_gets_its_engine():
    """GPU 0's actor holds a's engine, GPU 1's has b's parked: a on GPU 0 is a keep and b
    on GPU 1 a wake (nothing loaded); placed the other way round both would load."""
    problem = costed(TINY, 2, 1, [HeldEngines((0,), ("vicuna-13b-v1.5", 1)),
                                  HeldEngines((1,), ("", 0), (("chatglm3-6b", 1),))])
    load = {n: problem.profile(problem.node(n).model.name, 1).load_s for n in ("a", "b")}
    expected = {("a", (0,)): COSTS["keep_s"], ("b", (1,)): COSTS["wake_s"],
                ("a", (1,)): load["a"] + COSTS["swap_s"], ("b", (0,)): load["b"] + COSTS["swap_s"]}
    evaluator = StageEvaluator(problem, representative_replicas=False)
    state = initial_state(problem)
    ev = evaluator.evaluate(state, {"a": ExecPlan(1, 1), "b": ExecPlan(1, 1)})
    for node in ("a", "b"):
        (gpus,) = ev.placement[node]
        assert ev.runs[node].load_s == pytest.approx(expected[node, gpus])
    # dp2 of a: one replica keeps, the other swaps in b's parked GPU; the node waits for both
    ev = evaluator.evaluate(state, {"a": ExecPlan(2, 1)})
    assert sorted(ev.placement["a"]) == [(0,), (1,)]
    assert ev.runs["a"].load_s == pytest.approx(expected["a", (1,)])
    after = evaluator.advance(state, ev)
    assert switch_kind(after.actors, (1,), ("chatglm3-6b", 1)) == "swap"   # released: max_parked 1
    # a plain problem (no load costs) charges every tp1 load the same, as before
    plain = problem_of(TINY, 2, 1)
    ev = StageEvaluator(plain).evaluate(initial_state(plain), {"a": ExecPlan(1, 1)})
    assert ev.runs["a"].load_s == plain.load_seconds("a", ExecPlan(1, 1))


CHEAP_COLD = dict(cold_s=5.0, swap_s=20.0, wake_s=0.5, keep_s=0.0, max_parked=1)


@pytest.mark.parametrize("app,gpus,nvlink,actors,costs", [
    (TINY, 2, 1, [HeldEngines((0,), ("chatglm3-6b", 1)), HeldEngines((1,), ("", 0), (("vicuna-13b-v1.5", 1),))],
     COSTS),
    (FUSER, 4, 2, [HeldEngines((i,), ("", 0)) for i in range(3)] + [HeldEngines((3,), ("chatglm3-6b", 1))],
     COSTS),
    # two paths to the same progress with other engines held: a transposition table that
    # ignored the actors cut the better one (found by mutating state_key)
    (*small_case(22), [HeldEngines((0,), ("chatglm3-6b", 1)),
                       HeldEngines((1,), ("chatglm3-6b", 1), (("vicuna-13b-v1.5", 1),))], CHEAP_COLD),
])
def test_the_exact_searches_stay_exact_with_switch_costs(app, gpus, nvlink, actors, costs):
    """Branch and bound's lower bounds assume the cheapest switch and its transposition
    table keys on the actors' engines: it and ``optimal`` find the brute force's makespan;
    the default search is never worse than the greedy under the same costs."""
    exhaustive = brute_force(costed(app, gpus, nvlink, actors, costs))
    problem = costed(app, gpus, nvlink, actors, costs)
    ctx = SearchContext(problem, StageEvaluator(problem, representative_replicas=False))
    assert branch_and_bound(ctx, math.inf, [], stop=lambda: False).best_time == pytest.approx(exhaustive, rel=1e-9)
    opt = get_policy("optimal")(costed(app, gpus, nvlink, actors, costs))
    assert opt.proven_optimal and opt.makespan_s == pytest.approx(exhaustive, rel=1e-9)
    search = get_policy("samullm-search")(costed(app, gpus, nvlink, actors, costs))
    greedy = get_policy("samullm")(costed(app, gpus, nvlink, actors, costs))
    assert search.makespan_s <= greedy.makespan_s * (1 + 1e-9)
    kinds = {k for s in search.stages for m in s.models for k in m.switches}
    assert kinds and kinds <= {"cold", "swap", "wake", "keep"}


def test_the_parking_rule_against_a_brute_force_lru():
    """``park`` (the planner's and EngineActor.swap's one rule) against a hand-run LRU:
    every sequence of parks over four keys, at every limit."""
    import itertools

    from raycolo.offline.planner.engines import park

    for limit in range(0, 4):
        for seq in itertools.product("abcd", repeat=5):
            parked, lru = (), []
            for key in seq:
                if key in parked:                       # a wake takes it out first
                    parked = tuple(k for k in parked if k != key)
                    lru.remove(key)
                parked, released = park(parked, key, limit)
                lru.append(key)
                gone = []
                while len(lru) > limit:
                    gone.append(lru.pop(0))
                assert list(parked) == lru and sorted(released) == sorted(gone), (limit, seq)
    # a tensor-parallel engine is released, whatever the limit, and the others stay
    assert park(("a", "b"), "c", 3, tp=2) == (("a", "b"), ("c",))


def test_the_dispatch_rule_against_the_runtimes_old_loop():
    """RoundRobin (the planner's and the runtime's one dispatch rule) against a hand-run
    turn-by-turn loop, over random batches, chains and changing replica counts."""
    import numpy as np

    from raycolo.offline.planner.dispatch import RoundRobin

    rng = np.random.default_rng(0)
    for chained in (False, True):
        rule, turn, item_replica = RoundRobin(), 0, {}
        for _ in range(300):
            replicas = int(rng.integers(1, 5))
            items = rng.integers(0, 12, int(rng.integers(0, 9)))
            expect = []
            for item in items.tolist():
                if chained:
                    if item not in item_replica or item_replica[item] >= replicas:
                        item_replica[item] = turn % replicas
                        turn += 1
                    expect.append(item_replica[item])
                else:
                    expect.append(turn % replicas)
                    turn += 1
            got = rule.assign(len(items), replicas, items if chained else None)
            assert got.tolist() == expect
