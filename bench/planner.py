"""Planner benchmark: every policy on the paper's example applications, 8 GPUs.

Prints, per case, each policy's makespan, search time, end-to-end time (search plus
makespan), samullm's speedup over it and the gap to the lower bound; then the small
cases against the exhaustive ``optimal`` policy. All baselines run in the same process
on the same sampled workload. Search times are medians of ``--repeats`` runs.

    .venv/bin/python bench/planner.py [--quick] [--repeats 3] [--json out/bench_planner.json]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from raycolo.offline.dag import load_app, parse_app  # noqa: E402
from raycolo.hardware import make_cluster  # noqa: E402
from raycolo.offline.planner.problem import PlanningProblem  # noqa: E402
from raycolo.offline.planner.validate import plan_violations  # noqa: E402
from raycolo.offline.policies import get_policy  # noqa: E402
from raycolo.offline.workload import build_workload  # noqa: E402
from common import write_json  # noqa: E402

POLICIES = ["samullm-search", "samullm", "samullm-rollout", "samullm-window", "samullm-nopreempt", "max", "min"]

CASES = [  # (label, example, requests, output limit override)
    ("ensemble 1000/256", "ensemble", 1000, 256),
    ("ensemble 1000/512", "ensemble", 1000, 512),
    ("ensemble 10000/256", "ensemble", 10000, 256),
    ("ensemble 10000/512", "ensemble", 10000, 512),
    ("routing 6856/4096", "routing", None, None),
    ("chain summary 100 docs", "chain_summary", None, None),
    ("mixed 100 docs + 5000", "mixed", None, None),
]
QUICK = {"ensemble 10000/256", "ensemble 10000/512"}

SMALL_CASES = [  # (label, yaml, gpus)
    ("3 models, 4 GPUs, 600 req", """
name: small3
requests: {count: 600, input_tokens: {distribution: lognormal, min: 5, max: 127, mean: 21}}
nodes:
  - {name: vicuna, model: vicuna-13b-v1.5, max_output_tokens: 256}
  - {name: chatglm, model: chatglm3-6b, max_output_tokens: 256}
  - {name: mpt, model: mpt-7b-chat, max_output_tokens: 256}
edges: [{from: input, to: vicuna}, {from: input, to: chatglm}, {from: input, to: mpt}]
""", 4),
    ("4 models, 4 GPUs, 1000 req", """
name: small4
requests: {count: 1000, input_tokens: {distribution: lognormal, min: 5, max: 127, mean: 21}}
nodes:
  - {name: vicuna, model: vicuna-13b-v1.5, max_output_tokens: 256}
  - {name: dolly, model: dolly-v2-12b, max_output_tokens: 256}
  - {name: chatglm, model: chatglm3-6b, max_output_tokens: 256}
  - {name: stablelm, model: stablelm-tuned-alpha-7b, max_output_tokens: 256}
edges: [{from: input, to: vicuna}, {from: input, to: dolly}, {from: input, to: chatglm}, {from: input, to: stablelm}]
""", 4),
    ("chain 2 models, 4 GPUs, 20 docs", """
name: smallchain
sources:
  docs: {count: 20, chunk_tokens: 1024, chunks: {distribution: lognormal, median: 3, sigma: 1.0, max: 20}}
nodes:
  - {name: summ, model: vicuna-13b-v1.5, max_output_tokens: 400}
  - {name: judge, model: llama-2-13b-chat-hf, max_output_tokens: 300, repeat: 3}
edges: [{from: docs, to: summ}, {from: summ, to: summ}, {from: summ, to: judge}]
""", 4),
    ("routing 3 models, 2 GPUs, 800 req", """
name: smallroute
requests: {count: 800, input_tokens: {distribution: lognormal, min: 9, max: 577, mean: 310, sigma: 0.6}}
nodes:
  - {name: wizard, model: wizardlm-13b-v1.2, max_output_tokens: 1024, combine: route, route_weight: 5}
  - {name: mistral, model: mistral-7b-instruct-v0.2, max_output_tokens: 1024, combine: route, route_weight: 3}
  - {name: llama13, model: llama-2-13b-chat-hf, max_output_tokens: 1024, combine: route, route_weight: 2}
edges: [{from: input, to: wizard}, {from: input, to: mistral}, {from: input, to: llama13}]
""", 2),
]


def with_output_limit(app, limit):
    if limit is None:
        return app
    nodes = [n.model_copy(update={"max_output_tokens": limit}) for n in app.nodes]
    return app.model_copy(update={"nodes": nodes})


def run_case(app, requests, gpus, policies, repeats):
    workload = build_workload(app, seed=0, requests=requests)
    rows = {}
    for name in policies:
        searches, plan = [], None
        for _ in range(repeats if name not in ("optimal", "samullm-rollout") else 1):
            problem = PlanningProblem(workload, make_cluster(gpus))
            plan = get_policy(name)(problem)
            searches.append(plan.search_s)
            bad = plan_violations(problem, plan)
            if bad:
                raise SystemExit(f"{name}: invalid plan: {bad[0]}")
        rows[name] = {"makespan_s": plan.makespan_s, "search_s": statistics.median(searches),
                      "lower_bound_s": plan.lower_bound_s, "stages": len(plan.stages),
                      "simulations": plan.simulations}
    lower = max(r["lower_bound_s"] for r in rows.values())
    ref = rows.get("samullm")
    for r in rows.values():
        r["end_to_end_s"] = r["makespan_s"] + r["search_s"]
    for r in rows.values():
        r["samullm_speedup"] = r["end_to_end_s"] / ref["end_to_end_s"] if ref else None
        r["gap_to_lower_bound"] = r["makespan_s"] / lower - 1
    return rows, lower, workload.total_requests


def print_table(label, rows, lower, total, file=sys.stdout):
    print(f"\n### {label}  ({total} requests over all nodes, lower bound {lower:.1f}s)", file=file)
    print("| policy | makespan s | search s | end-to-end s | samullm speedup | gap to LB |", file=file)
    print("|---|---:|---:|---:|---:|---:|", file=file)
    for name, r in rows.items():
        speed = f"{r['samullm_speedup']:.2f}x" if r["samullm_speedup"] else "-"
        print(f"| {name} | {r['makespan_s']:.1f} | {r['search_s']:.2f} | {r['end_to_end_s']:.1f} "
              f"| {speed} | {r['gap_to_lower_bound']:+.1%} |", file=file)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="skip the 10,000-request cases")
    ap.add_argument("--repeats", type=int, default=3, help="search-time repeats (median)")
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--skip-small", action="store_true", help="skip the optimal comparison")
    args = ap.parse_args()

    started = time.perf_counter()
    report = {"cases": {}, "small_cases": {}}
    print("Planner benchmark: 8 GPUs x 80 GiB, NVLink pairs, seed 0; "
          "samullm speedup = policy end-to-end / samullm end-to-end")
    for label, example, requests, limit in CASES:
        if args.quick and label in QUICK:
            continue
        app = with_output_limit(load_app(ROOT / "examples" / f"{example}.yaml"), limit)
        rows, lower, total = run_case(app, requests, 8, POLICIES, args.repeats)
        report["cases"][label] = {"rows": rows, "lower_bound_s": lower, "requests": total}
        print_table(label, rows, lower, total)
        sys.stdout.flush()

    print("\n## samullm targets")
    print("| case | search s (median) | target | makespan <= max and min |")
    print("|---|---:|---:|---|")
    for label, case in report["cases"].items():
        r = case["rows"]
        target = 1.0 if label.startswith("ensemble 1000/") else 5.0
        ok = r["samullm"]["makespan_s"] <= min(r["max"]["makespan_s"], r["min"]["makespan_s"]) * 1.0001
        print(f"| {label} | {r['samullm']['search_s']:.2f} | < {target:.0f} | {'yes' if ok else 'NO'} |")

    if not args.skip_small:
        print("\n## Small cases against the exhaustive optimum")
        print("| case | optimal s | samullm s | samullm / optimal | rollout / optimal | max / optimal | min / optimal | optimal search s |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
        for label, spec, gpus in SMALL_CASES:
            app = parse_app(yaml.safe_load(spec))
            rows, _, _ = run_case(app, None, gpus, ["optimal"] + POLICIES, 1)
            report["small_cases"][label] = rows
            o = rows["optimal"]["makespan_s"]
            print(f"| {label} | {o:.1f} | {rows['samullm']['makespan_s']:.1f} "
                  f"| {rows['samullm']['makespan_s'] / o:.3f} | {rows['samullm-rollout']['makespan_s'] / o:.3f} "
                  f"| {rows['max']['makespan_s'] / o:.3f} | {rows['min']['makespan_s'] / o:.3f} "
                  f"| {rows['optimal']['search_s']:.1f} |")
            sys.stdout.flush()
    print(f"\nbenchmark wall time {time.perf_counter() - started:.0f}s")
    if args.json:
        write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
