"""The default search policy and the ``optimal`` reference (issue 14): certificates in the
JSON, never worse than the greedy, optimal against an unpruned brute force, budgets."""
from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from raycolo.offline.dag import parse_app
from raycolo.hardware import make_cluster
from raycolo.offline.planner.branch import all_selections, branch_and_bound
from raycolo.offline.planner.problem import PlanningProblem
from raycolo.offline.planner.search import SearchContext
from raycolo.offline.planner.state import StageEvaluator, initial_state
from raycolo.offline.planner.validate import plan_violations
from raycolo.offline.policies import DEFAULT_OFFLINE_POLICY, get_policy, policy_names
from raycolo.offline.workload import build_workload

REPO = Path(__file__).resolve().parents[2]
MODELS = ["vicuna-13b-v1.5", "chatglm3-6b", "mpt-7b-chat", "mistral-7b-instruct-v0.2",
          "llama-2-7b-chat-hf", "dolly-v2-12b"]

TINY = {  # two models answer 40 short requests, 2 GPUs: a few dozen stage sequences
    "name": "tiny-search",
    "requests": {"count": 40, "input_tokens": {"distribution": "uniform", "min": 5, "max": 60}},
    "nodes": [{"name": "a", "model": "vicuna-13b-v1.5", "max_output_tokens": 96},
              {"name": "b", "model": "chatglm3-6b", "max_output_tokens": 128}],
    "edges": [{"from": "input", "to": "a"}, {"from": "input", "to": "b"}],
}


FUSER = {  # two answers, then a model that reads both (waits for its inputs, loaded early)
    "name": "tiny-fuser",
    "requests": {"count": 24, "input_tokens": {"distribution": "uniform", "min": 5, "max": 40}},
    "nodes": [{"name": "a", "model": "mistral-7b-instruct-v0.2", "max_output_tokens": 48},
              {"name": "b", "model": "chatglm3-6b", "max_output_tokens": 64},
              {"name": "f", "model": "llama-2-7b-chat-hf", "max_output_tokens": 24,
               "combine": "concat", "prompt": "{a} {b}"}],
    "edges": [{"from": "input", "to": "a"}, {"from": "input", "to": "b"},
              {"from": "a", "to": "f"}, {"from": "b", "to": "f"}],
}

CHAIN = {  # a self-loop chain and a judge
    "name": "tiny-chain",
    "sources": {"docs": {"count": 4, "chunk_tokens": 512,
                         "chunks": {"distribution": "uniform", "min": 1, "max": 3}}},
    "nodes": [{"name": "s", "model": "llama-2-7b-chat-hf", "max_output_tokens": 60},
              {"name": "j", "model": "chatglm3-6b", "max_output_tokens": 40}],
    "edges": [{"from": "docs", "to": "s"}, {"from": "s", "to": "s"}, {"from": "s", "to": "j"}],
}

TREE_CASES = [(TINY, 2, 1), (FUSER, 4, 2), (CHAIN, 4, 2)]


def problem_of(app: dict, gpus: int = 2, nvlink: int = 1, memory: str = "80GiB", seed: int = 0):
    return PlanningProblem(build_workload(parse_app(app), seed=seed), make_cluster(gpus, memory, nvlink))


def small_case(seed: int) -> tuple[dict, int, int]:
    """A seeded small application: ensemble, ensemble + fuser, routing or chain."""
    import random
    rng = random.Random(seed)
    kind = ["ensemble", "fuser", "routing", "chain"][seed % 4]
    models = rng.sample(MODELS, 3)
    q = {"count": rng.randint(1, 3) * 40,
         "input_tokens": {"distribution": "lognormal", "min": 5, "max": 200, "mean": 40, "sigma": 0.8}}
    if kind == "chain":
        app = {"name": "c", "sources": {"docs": {"count": rng.randint(4, 8), "chunk_tokens": 512,
                                                  "chunks": {"distribution": "lognormal", "median": 2,
                                                             "sigma": 0.8, "min": 1, "max": 6}}},
               "nodes": [{"name": "s", "model": models[0], "max_output_tokens": 120},
                         {"name": "j", "model": models[1], "max_output_tokens": 80, "repeat": 2}],
               "edges": [{"from": "docs", "to": "s"}, {"from": "s", "to": "s"}, {"from": "s", "to": "j"}]}
    else:
        k = 2 if kind == "fuser" else rng.randint(2, 3)
        nodes = [{"name": f"m{i}", "model": models[i], "max_output_tokens": rng.choice([64, 128])}
                 for i in range(k)]
        if kind == "routing":
            for n in nodes:
                n.update(combine="route", route_weight=rng.randint(1, 4))
        edges = [{"from": "input", "to": n["name"]} for n in nodes]
        if kind == "fuser":
            nodes.append({"name": "f", "model": models[2], "max_output_tokens": 48, "combine": "concat",
                          "prompt": "{m0} {m1}"})
            edges += [{"from": "m0", "to": "f"}, {"from": "m1", "to": "f"}]
        app = {"name": kind, "requests": q, "nodes": nodes, "edges": edges}
    gpus, nvlink = rng.choice([(2, 1), (2, 2), (4, 2)])
    return app, gpus, nvlink


def brute_force(problem: PlanningProblem) -> float:
    """Shortest makespan over every stage sequence, no bounds, no memo (tiny cases only)."""
    ctx = SearchContext(problem, StageEvaluator(problem, representative_replicas=False))

    def best(state) -> float:
        if state.finished:
            return state.time
        out = math.inf
        for selection in all_selections(ctx, state):
            ev = ctx.evaluate(state, selection, exact=True)
            if ev is not None:
                out = min(out, best(ctx.evaluator.advance(state, ev)))
        return out
    return best(initial_state(problem))


def test_default_policy_is_the_search_and_samullm_still_works():
    assert DEFAULT_OFFLINE_POLICY == "samullm-search" and DEFAULT_OFFLINE_POLICY in policy_names()
    from raycolo.cli.main import build_parser
    parser = build_parser()
    assert parser.parse_args(["plan", "x.yaml"]).policy == DEFAULT_OFFLINE_POLICY
    assert parser.parse_args(["run", "x.yaml"]).policy == DEFAULT_OFFLINE_POLICY
    assert parser.parse_args(["plan", "x.yaml", "--policy", "samullm"]).policy == "samullm"


@pytest.mark.parametrize("app,gpus,nvlink", TREE_CASES)
def test_optimal_matches_brute_force_and_beats_every_policy(app, gpus, nvlink):
    exhaustive = brute_force(problem_of(app, gpus, nvlink))
    # the bounds and the transposition table alone, from no incumbent, find it too
    problem = problem_of(app, gpus, nvlink)
    ctx = SearchContext(problem, StageEvaluator(problem, representative_replicas=False))
    assert branch_and_bound(ctx, math.inf, [], stop=lambda: False).best_time == pytest.approx(exhaustive, rel=1e-9)
    opt = get_policy("optimal")(problem_of(app, gpus, nvlink))
    assert opt.proven_optimal is True and opt.optimality_gap == 0.0
    assert opt.makespan_s == pytest.approx(exhaustive, rel=1e-9)
    assert opt.lower_bound_s == pytest.approx(opt.makespan_s)
    for name in policy_names():
        if name == "optimal":
            continue
        plan = get_policy(name)(problem_of(app, gpus, nvlink))
        assert plan_violations(problem_of(app, gpus, nvlink), plan) == [], name
        assert opt.makespan_s <= plan.makespan_s * (1 + 1e-9), name


def test_optimal_stopped_early_reports_a_valid_bound():
    app, gpus, nvlink = small_case(1)  # ensemble + fuser: not provable in no time
    full = get_policy("optimal")(problem_of(app, gpus, nvlink, seed=1))
    assert full.proven_optimal
    cut = get_policy("optimal")(problem_of(app, gpus, nvlink, seed=1), time_limit_s=0.0)
    assert cut.makespan_s >= full.makespan_s * (1 - 1e-9)
    if not cut.proven_optimal:
        assert cut.optimality_gap is not None and cut.optimality_gap >= 0
        # the bound left by the stopped search never exceeds the true optimum
        assert cut.lower_bound_s <= full.makespan_s * (1 + 1e-9)
        assert cut.makespan_s == pytest.approx(cut.lower_bound_s * (1 + cut.optimality_gap))


@pytest.mark.parametrize("seed", range(10))
def test_search_never_worse_than_greedy_and_close_to_optimal(seed):
    app, gpus, nvlink = small_case(seed)
    plans = {name: get_policy(name)(problem_of(app, gpus, nvlink, seed=seed))
             for name in ("samullm", "samullm-nopreempt", DEFAULT_OFFLINE_POLICY)}
    search = plans[DEFAULT_OFFLINE_POLICY]
    assert plan_violations(problem_of(app, gpus, nvlink, seed=seed), search) == []
    for name in ("samullm", "samullm-nopreempt"):
        assert search.makespan_s <= plans[name].makespan_s * (1 + 1e-9), name
    if search.proven_optimal:  # then it must match the independent reference
        ref = get_policy("optimal")(problem_of(app, gpus, nvlink, seed=seed))
        assert ref.proven_optimal
        assert search.makespan_s == pytest.approx(ref.makespan_s, rel=1e-9)


def test_search_is_deterministic():
    app, gpus, nvlink = small_case(3)
    a = get_policy(DEFAULT_OFFLINE_POLICY)(problem_of(app, gpus, nvlink)).to_dict()
    b = get_policy(DEFAULT_OFFLINE_POLICY)(problem_of(app, gpus, nvlink)).to_dict()
    for d in (a, b):
        d.pop("search_s"), d.pop("end_to_end_s"), d.pop("notes")
    assert a == b


def test_search_respects_its_budget():
    from raycolo.offline.policies.samullm_search import HARD_LIMIT_FACTOR
    app = {**TINY, "requests": {"count": 400, "input_tokens": {"distribution": "uniform", "min": 5, "max": 200}},
           "nodes": [{"name": f"n{i}", "model": m, "max_output_tokens": 256}
                     for i, m in enumerate(MODELS[:4])],
           "edges": [{"from": "input", "to": f"n{i}"} for i in range(4)]}
    seeds = 0.0
    for name in ("samullm", "samullm-nopreempt"):  # the two seeds the search always runs
        started = time.perf_counter()
        get_policy(name)(problem_of(app, 4, 4))
        seeds += time.perf_counter() - started
    # no budget: exactly the best of the two seeds
    zero = get_policy(DEFAULT_OFFLINE_POLICY)(problem_of(app, 4, 4), budget_s=0.0)
    best_seed = min(get_policy(n)(problem_of(app, 4, 4)).makespan_s for n in ("samullm", "samullm-nopreempt"))
    assert zero.makespan_s == pytest.approx(best_seed, rel=1e-9)
    budget = 0.3
    plan = get_policy(DEFAULT_OFFLINE_POLICY)(problem_of(app, 4, 4), budget_s=budget)
    assert plan.makespan_s <= zero.makespan_s * (1 + 1e-9)
    # the seeds, then at most the wall-clock guard (plus one stage's simulations)
    assert plan.search_s <= 1.5 * seeds + HARD_LIMIT_FACTOR * budget + 1.0, plan.notes


def _cli_json(*args) -> dict:
    proc = subprocess.run([sys.executable, "-m", "raycolo.cli", *map(str, args), "--json"],
                          capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_plan_and_compare_json_carry_the_certificate(tmp_path):
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(TINY, sort_keys=False))
    flags = ("--gpus", 2, "--nvlink-group", 1)
    plan = _cli_json("plan", path, *flags)
    assert plan["policy"] == DEFAULT_OFFLINE_POLICY
    assert {"proven_optimal", "optimality_gap", "lower_bound_s"} <= set(plan)
    report = _cli_json("compare", path, *flags, "--policies", f"samullm,{DEFAULT_OFFLINE_POLICY},optimal")
    by = {r["policy"]: r for r in report["results"]}
    for r in report["results"]:
        assert {"proven_optimal", "optimality_gap", "lower_bound_s"} <= set(r)
    assert by["optimal"]["proven_optimal"] is True and by["optimal"]["optimality_gap"] == 0.0
    assert report["optimal"]["proven_optimal"] is True
    assert by["samullm"]["proven_optimal"] is False and by["samullm"]["optimality_gap"] is None
    assert by["optimal"]["makespan_s"] <= by["samullm"]["makespan_s"] + 1e-9
    assert plan["makespan_s"] == pytest.approx(by[DEFAULT_OFFLINE_POLICY]["makespan_s"], rel=1e-9)
    explicit = _cli_json("plan", path, *flags, "--policy", "samullm")
    assert explicit["policy"] == "samullm"
    assert explicit["makespan_s"] == pytest.approx(by["samullm"]["makespan_s"], rel=1e-9)
