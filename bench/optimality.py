"""How close each offline policy gets to ``optimal`` on random small applications.

Generates ``--count`` seeded random applications of the kinds the paper studies, small
enough for the exhaustive search: ensembles, ensemble + fuser (a model that reads all
answers), routing, chain summaries (a self-loop) and mixes of a chain with an ensemble;
2-4 models of 6-13 B, 2-4 GPUs, NVLink groups of 1-4 GPUs, 40-80 GiB per GPU. Every
policy plans the same sampled workload; ``optimal`` gets ``--time-limit`` seconds per
case. For each policy it prints the median and worst makespan / optimal and the share of
cases within 5 %, over the cases ``optimal`` proved (the others are counted, not used).

    .venv/bin/python bench/optimality.py [--count 30] [--seed 0] [--time-limit 30] [--json]
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from raycolo.offline.dag import parse_app  # noqa: E402
from raycolo.hardware import make_cluster  # noqa: E402
from raycolo.offline.planner.problem import PlanningProblem  # noqa: E402
from raycolo.offline.planner.validate import plan_violations  # noqa: E402
from raycolo.offline.policies import DEFAULT_OFFLINE_POLICY, get_policy  # noqa: E402
from raycolo.offline.workload import build_workload  # noqa: E402

POLICIES = ["samullm", "samullm-rollout", "samullm-nopreempt", "max", "min", DEFAULT_OFFLINE_POLICY]
MODELS = [  # 6-13 B models of the catalog
    "vicuna-13b-v1.5", "oasst-sft-4-pythia-12b-epoch-3.5", "alpaca-13b", "baize-v2-13b",
    "koala-13b-hf", "dolly-v2-12b", "mpt-7b-chat", "chatglm3-6b", "stablelm-tuned-alpha-7b",
    "wizardlm-13b-v1.2", "mistral-7b-instruct-v0.2", "llama-2-13b-chat-hf", "llama-2-7b-chat-hf"]
KINDS = ["ensemble", "fuser", "routing", "chain", "mix"]
CLUSTERS = [(2, 1), (2, 2), (3, 1), (3, 3), (4, 1), (4, 2), (4, 4)]  # (GPUs, NVLink group)
MEMORY = ["40GiB", "48GiB", "80GiB"]


def random_case(seed: int) -> dict:
    """One application, its machine and sampling seed, all from ``seed``."""
    rng = random.Random(seed)
    kind = KINDS[rng.randrange(len(KINDS))]
    n = rng.randint(3, 4) if kind in ("fuser", "mix") else (2 if kind == "chain" else rng.randint(2, 4))
    models = rng.sample(MODELS, n)
    out = rng.choice([128, 256, 512])
    questions = {"count": rng.randint(2, 8) * 100,
                 "input_tokens": {"distribution": "lognormal", "min": 5, "max": 400,
                                  "mean": rng.choice([21, 80, 200]), "sigma": 0.8}}
    nodes, edges = [], []
    if kind in ("ensemble", "fuser", "routing"):
        k = n - 1 if kind == "fuser" else n
        for i in range(k):
            node = {"name": f"m{i}", "model": models[i], "max_output_tokens": out}
            if kind == "routing":
                node.update(combine="route", route_weight=rng.randint(1, 5), max_output_tokens=2 * out)
            nodes.append(node)
            edges.append({"from": "input", "to": f"m{i}"})
        if kind == "fuser":
            nodes.append({"name": "fuser", "model": models[-1], "max_output_tokens": 128,
                          "combine": "concat", "prompt": "Merge: " + " ".join(f"{{m{i}}}" for i in range(k))})
            edges += [{"from": f"m{i}", "to": "fuser"} for i in range(k)]
        app = {"name": f"{kind}{seed}", "requests": questions, "nodes": nodes, "edges": edges}
    else:
        docs = {"count": rng.randint(8, 24), "chunk_tokens": rng.choice([512, 1024, 2048]),
                "chunks": {"distribution": "lognormal", "median": 3, "sigma": 1.0, "min": 1, "max": 16}}
        nodes = [{"name": "summ", "model": models[0], "max_output_tokens": rng.choice([200, 300, 500])},
                 {"name": "judge", "model": models[1], "max_output_tokens": 200, "repeat": rng.randint(1, 3)}]
        edges = [{"from": "docs", "to": "summ"}, {"from": "summ", "to": "summ"}, {"from": "summ", "to": "judge"}]
        sources = {"docs": docs}
        if kind == "mix":
            questions["count"] //= 2
            sources["input"] = questions
            for i in range(2, n):
                nodes.append({"name": f"m{i}", "model": models[i], "max_output_tokens": out})
                edges.append({"from": "input", "to": f"m{i}"})
        app = {"name": f"{kind}{seed}", "sources": sources, "nodes": nodes, "edges": edges}
    gpus, nvlink = rng.choice(CLUSTERS)
    return {"seed": seed, "kind": kind, "app": app, "gpus": gpus, "nvlink_group": nvlink,
            "gpu_memory": rng.choice(MEMORY)}


def build_problem(case: dict) -> PlanningProblem:
    workload = build_workload(parse_app(case["app"]), seed=case["seed"])
    return PlanningProblem(workload, make_cluster(case["gpus"], case["gpu_memory"], case["nvlink_group"]))


def run_case(case: dict, policies: list[str], time_limit_s: float) -> dict:
    rows = {}
    for name in policies + ["optimal"]:
        problem = build_problem(case)
        kwargs = {"time_limit_s": time_limit_s} if name == "optimal" else {}
        plan = get_policy(name)(problem, **kwargs)
        bad = plan_violations(problem, plan)
        if bad:
            raise SystemExit(f"case {case['seed']} {name}: invalid plan: {bad[0]}")
        rows[name] = {"makespan_s": plan.makespan_s, "search_s": plan.search_s,
                      "proven_optimal": plan.proven_optimal, "optimality_gap": plan.optimality_gap,
                      "lower_bound_s": plan.lower_bound_s}
    return rows


def summarize(cases: list[dict], policies: list[str]) -> dict:
    proven = [c for c in cases if c["rows"]["optimal"]["proven_optimal"]]
    out = {"cases": len(cases), "proven": len(proven), "unproven": len(cases) - len(proven),
           "policies": {}}
    for name in policies:
        ratios = [c["rows"][name]["makespan_s"] / c["rows"]["optimal"]["makespan_s"] for c in proven]
        searches = [c["rows"][name]["search_s"] for c in cases]
        out["policies"][name] = {
            "median_ratio": statistics.median(ratios) if ratios else None,
            "worst_ratio": max(ratios) if ratios else None,
            "within_5pct": sum(r <= 1.05 + 1e-9 for r in ratios) / len(ratios) if ratios else None,
            "median_search_s": statistics.median(searches), "max_search_s": max(searches),
        }
    default = DEFAULT_OFFLINE_POLICY
    out["default_never_worse_than_samullm"] = all(
        c["rows"][default]["makespan_s"] <= c["rows"]["samullm"]["makespan_s"] * (1 + 1e-9) for c in cases)
    return out


def print_summary(summary: dict, file=sys.stdout) -> None:
    print(f"\n{summary['cases']} cases, optimal proven on {summary['proven']} "
          f"({summary['unproven']} unproven, left out of the ratios)", file=file)
    print("| policy | median / optimal | worst / optimal | within 5 % | median search s | max search s |", file=file)
    print("|---|---:|---:|---:|---:|---:|", file=file)
    for name, r in summary["policies"].items():
        if r["median_ratio"] is None:
            print(f"| {name} | - | - | - | {r['median_search_s']:.2f} | {r['max_search_s']:.2f} |", file=file)
            continue
        print(f"| {name} | {r['median_ratio']:.3f} | {r['worst_ratio']:.3f} | {r['within_5pct']:.0%} "
              f"| {r['median_search_s']:.2f} | {r['max_search_s']:.2f} |", file=file)
    print(f"{DEFAULT_OFFLINE_POLICY} never worse than samullm: "
          f"{'yes' if summary['default_never_worse_than_samullm'] else 'NO'}", file=file)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--count", type=int, default=30, help="random applications (default 30)")
    ap.add_argument("--seed", type=int, default=0, help="first case seed (default 0)")
    ap.add_argument("--time-limit", type=float, default=30.0, help="optimal's seconds per case (default 30)")
    ap.add_argument("--policies", default=",".join(POLICIES), help="comma-separated policies")
    ap.add_argument("--json", action="store_true", help="print JSON (cases and summary) instead of tables")
    args = ap.parse_args(argv)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]

    started = time.perf_counter()
    cases = []
    log = sys.stderr if args.json else sys.stdout
    if not args.json:
        print("| case | kind | models | GPUs | NVLink | optimal s | proven | " +
              " | ".join(f"{p} / opt" for p in policies) + " |")
        print("|---|---|---:|---:|---:|---:|---|" + "---:|" * len(policies))
    for seed in range(args.seed, args.seed + args.count):
        case = random_case(seed)
        rows = run_case(case, policies, args.time_limit)
        case["rows"] = rows
        cases.append(case)
        o = rows["optimal"]
        ratios = " | ".join(f"{rows[p]['makespan_s'] / o['makespan_s']:.3f}" for p in policies)
        print(f"| {seed} | {case['kind']} | {len(case['app']['nodes'])} | {case['gpus']} | {case['nvlink_group']} "
              f"| {o['makespan_s']:.1f} | {'yes' if o['proven_optimal'] else 'no (gap %.1f%%)' % (100 * o['optimality_gap'])} "
              f"| {ratios} |", file=log, flush=True)
    summary = summarize(cases, policies)
    summary["wall_s"] = time.perf_counter() - started
    if args.json:
        print(json.dumps({"summary": summary, "cases": cases}, indent=2))
    else:
        print_summary(summary)
        print(f"\nbenchmark wall time {summary['wall_s']:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
