"""Live online benchmark: LeMix, NaiveMix and SEPARATE on real stage workers, and the
simulator on the same trace.

On a local Ray cluster: 2 nodes x 2 stages (logical GPUs, gloo), a tiny model on CPU, one
deployment for every policy (``use_policy`` between runs; the workers and their adapters
stay). The same seeded Poisson trace for each policy. For each: throughput, SLO
attainment, TTFT and TBT p50/p99, training samples per second, stage busy fraction,
decision overhead (controller µs per task) and actor hops per decode iteration; held-out
loss of the training distribution before and after all runs. Then the simulator on the
same trace with the profile fitted from the live warm-up, and the live/simulated ratios.

    .venv/bin/python bench/online_live.py [--tasks 40] [--rate 3] [--train-rate 0.3]
        [--policies lemix,mix-rr,separate] [--config examples/online.yaml] [--raylets 2]
        [--rates 3,10,20 --repeats 3 --seconds 10] [--json out/bench_online_live.json]

``--rates``/``--repeats``: every rate, ``--repeats`` runs each (seeds ``--seed``, +1, ...;
``--seconds`` of arrivals per run, so ``--tasks`` = rate x seconds), then a table of the
medians and min-max spread per rate and policy, and whether the first policy is at least
each other one on SLO attainment and throughput within the spread (the larger of the two
policies' max - min).

``--raylets N``: the same on a Ray cluster of N raylets on this machine
(``ray.cluster_utils.Cluster``, node IP 127.0.0.1), the config's nodes spread over them
(each raylet holds the logical GPUs of ``nodes / N`` nodes), so activations stay inside
a raylet and the controller, the stage workers and the HTTP side talk across raylets.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from raycolo.online.config import load_online_config  # noqa: E402
from raycolo.online.profiles import NodeProfile  # noqa: E402
from raycolo.online.simulation.sim import simulate  # noqa: E402
from raycolo.online.tasks import poisson_workload  # noqa: E402
from raycolo.online.policies import make_online_policy  # noqa: E402
from common import holds_within_spread, write_json  # noqa: E402

PAPER_THROUGHPUT_RATIO, PAPER_SLO_RATIO = 3.53, 2.12


def trace(args, train_rate):
    tasks = poisson_workload(args.rate, train_rate, args.tasks, seed=args.seed)
    for t in tasks:  # tiny CPU model: short prompts and outputs
        t.length = max(2, min(t.length, args.max_length))
        if not t.is_train:
            t.decode_tokens = t.max_tokens = max(1, min(t.decode_tokens, args.max_decode))
    return tasks


def start_raylets(config, raylets: int):
    """A Ray cluster of ``raylets`` raylets on this machine, the config's worker groups
    spread over them (each raylet: the logical GPUs and CPUs of its share of nodes; the
    head one CPU more for the controller and the driver)."""
    import math

    from ray.cluster_utils import Cluster

    if not 1 <= raylets <= config.nodes:
        raise SystemExit(f"error: --raylets: between 1 and the config's nodes ({config.nodes})")
    share = math.ceil(config.nodes / raylets)
    gpus = share * config.stages
    cpus = max(1, math.ceil(gpus * config.stage.cpus_per_worker))
    env = config.cluster_env()
    cluster = Cluster(initialize_head=True, head_node_args=dict(
        node_ip_address="127.0.0.1", num_gpus=gpus, num_cpus=cpus + 2, include_dashboard=False, env_vars=env))
    for _ in range(raylets - 1):
        cluster.add_node(node_ip_address="127.0.0.1", num_gpus=gpus, num_cpus=cpus, env_vars=env)
    cluster.wait_for_nodes()
    return cluster


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "examples" / "online.yaml"))
    ap.add_argument("--policies", default="lemix,mix-rr,separate")
    ap.add_argument("--tasks", type=int, default=40)
    ap.add_argument("--rate", type=float, default=3.0)
    ap.add_argument("--train-rate", type=float, default=None)
    ap.add_argument("--max-length", type=int, default=48)
    ap.add_argument("--max-decode", type=int, default=12)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--raylets", type=int, default=1,
                    help="raylets to spread the nodes over (ray.cluster_utils.Cluster); 1: one local raylet")
    ap.add_argument("--rates", default=None, help="comma-separated rates, each run --repeats times")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--seconds", type=float, default=10.0, help="with --rates: seconds of arrivals per run")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.rates:
        return grid(args)
    from raycolo.actors.online.launch import OnlineDeployment

    config = load_online_config(args.config).model_copy(update={"resume": False})   # each run from the base model
    if args.train_rate is not None:
        config = config.model_copy(update={"train_rate": args.train_rate})
    tasks = trace(args, config.train_rate)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    started = time.perf_counter()
    cluster = start_raylets(config, args.raylets) if args.raylets > 1 else None
    try:
        dep = OnlineDeployment.start(config, address=cluster.address if cluster else None)
    except BaseException:
        if cluster is not None:
            cluster.shutdown()
        raise
    startup = time.perf_counter() - started
    rows, held_out = {}, {}
    try:
        placed = dep.placement()          # which raylet runs the controller and each stage worker
        raylet = {ray_node: f"raylet {i}" for i, ray_node in
                  enumerate(dict.fromkeys([placed["controller"], *sorted(placed["stage_workers"].values())]))}
        where_run = "controller on " + raylet[placed["controller"]] + "; " + ", ".join(
            f"{key} on {raylet[ray_node]}" for key, ray_node in sorted(placed["stage_workers"].items()))
        held_out["before"] = dep.held_out_loss(seed=999)
        warm = trace(argparse.Namespace(**{**vars(args), "tasks": 12, "seed": args.seed + 100}), 0.5)
        dep.replay(warm, seed=7)                     # warm-up: the profile learner fits η
        profile = NodeProfile.model_validate_json(dep.profile_json())
        for name in policies:
            dep.use_policy(name)
            result = dep.replay(tasks, seed=args.seed)
            stats = dep.stats()
            summary = result.summary()
            summary["train_samples_per_s"] = summary["train_done"] * config.lora.micro_batch / summary["makespan_s"]
            summary["stage_busy_fraction"] = 1 - summary["idle_fraction"]
            summary["actor_hops_per_decode_iteration"] = stats["hops_per_decode_iteration"]
            summary["decision_us_p50"], summary["decision_us_p99"] = stats["decision_us_p50"], stats["decision_us_p99"]
            summary["scheduling_us_per_task"] = stats["scheduling_us_per_task"]
            summary["controller_cpu_ms_per_task"] = stats["controller_cpu_ms_per_task"]
            summary["controller_sustains_tasks_per_s"] = stats["controller_sustains_tasks_per_s"]
            summary["scheduling_us_p50"], summary["scheduling_us_p99"] = stats["scheduling_us_p50"], stats["scheduling_us_p99"]
            sim = simulate(tasks, profile, config.nodes,
                           make_online_policy(name, config.lemix, nodes=config.nodes, train_rate=config.train_rate),
                           config.lemix).summary()
            summary["sim_throughput"], summary["sim_ttft_p50_s"] = sim["throughput"], sim["ttft_p50_s"]
            rows[name] = summary
            print(f"[online-live] {name}: {summary['throughput']:.2f} tasks/s live, "
                  f"{sim['throughput']:.2f} simulated", file=sys.stderr, flush=True)
        held_out["after"] = dep.held_out_loss(seed=999)
    finally:
        dep.stop()
        if cluster is not None:
            import ray

            ray.shutdown()
            cluster.shutdown()
    where = f"{args.raylets} raylets" if cluster is not None else "one raylet"
    print(f"Live online benchmark ({where}): {config.nodes} x {config.stages} {config.model_loading_config.model_id}, "
          f"{args.tasks} tasks at {args.rate:g}/s, training share {config.train_rate:g}; start-up {startup:.1f} s")
    print(f"placement: {where_run}")
    print("| policy | tasks/s | SLO att. | TTFT p50/p99 ms | TBT p50/p99 ms | train samples/s | "
          "stage busy | decision µs p50/p99 | sched. µs/task (p50/p99 per event) | controller CPU ms/task "
          "(sustains tasks/s) | hops/decode it. | sim tasks/s | live/sim thr | live/sim TTFT p50 |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, r in rows.items():
        print(f"| {name} | {r['throughput']:.2f} | {r['slo_attainment']:.2f} | "
              f"{r['ttft_p50_s'] * 1e3:.0f}/{r['ttft_p99_s'] * 1e3:.0f} | {r['tbt_p50_s'] * 1e3:.0f}/"
              f"{r['tbt_p99_s'] * 1e3:.0f} | {r['train_samples_per_s']:.2f} | {r['stage_busy_fraction']:.2f} | "
              f"{r['decision_us_p50']:.0f}/{r['decision_us_p99']:.0f} | {r['scheduling_us_per_task']:.0f} "
              f"({r['scheduling_us_p50']:.0f}/{r['scheduling_us_p99']:.0f}) | {r['controller_cpu_ms_per_task']:.1f} "
              f"({r['controller_sustains_tasks_per_s']:.0f}) | {r['actor_hops_per_decode_iteration']:.1f} | "
              f"{r['sim_throughput']:.2f} | {r['throughput'] / r['sim_throughput']:.2f} | "
              f"{r['ttft_p50_s'] / r['sim_ttft_p50_s']:.2f} |")
    print(f"\nheld-out loss (training distribution): before {held_out['before']:.3f}, after {held_out['after']:.3f}")
    if "lemix" in rows and "separate" in rows:
        thr = rows["lemix"]["throughput"] / rows["separate"]["throughput"]
        slo = rows["lemix"]["slo_attainment"] / max(rows["separate"]["slo_attainment"], 1e-9)
        sthr = rows["lemix"]["sim_throughput"] / rows["separate"]["sim_throughput"]
        print(f"\nlemix / separate: throughput {thr:.2f}x live, {sthr:.2f}x simulated (paper: up to "
              f"{PAPER_THROUGHPUT_RATIO}x); SLO attainment {slo:.2f}x live (paper: up to {PAPER_SLO_RATIO}x)")
    if args.json:
        write_json(args.json, {"rows": rows, "held_out": held_out, "startup_s": startup, "raylets": args.raylets,
                               "placement": placed})
    return 0


def grid(args) -> int:
    """Every rate of ``--rates``, ``--repeats`` runs each, on one deployment (module docstring)."""
    import statistics

    from raycolo.actors.online.launch import OnlineDeployment

    config = load_online_config(args.config).model_copy(update={"resume": False})
    if args.train_rate is not None:
        config = config.model_copy(update={"train_rate": args.train_rate})
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    rates = [float(r) for r in args.rates.split(",")]
    started = time.perf_counter()
    dep = OnlineDeployment.start(config)
    runs: dict = {}
    try:
        warm = trace(argparse.Namespace(**{**vars(args), "tasks": 12, "seed": args.seed + 100, "rate": 3.0}), 0.5)
        dep.replay(warm, seed=7)
        for rate in rates:
            for r in range(args.repeats):
                sub = argparse.Namespace(**{**vars(args), "rate": rate, "tasks": max(4, int(rate * args.seconds)),
                                            "seed": args.seed + r})
                tasks = trace(sub, config.train_rate)
                for name in policies:
                    dep.use_policy(name)
                    s = dep.replay(tasks, seed=sub.seed).summary()
                    s["decision_us_p50"] = dep.stats()["decision_us_p50"]
                    runs.setdefault((rate, name), []).append(s)
                    print(f"[online-live] {rate:g}/s run {r}: {name} {s['throughput']:.2f} tasks/s, "
                          f"SLO {s['slo_attainment']:.2f}, TTFT p50 {s['ttft_p50_s'] * 1e3:.0f} ms",
                          file=sys.stderr, flush=True)
    finally:
        dep.stop()
    first = policies[0]

    print(f"Live online grid: {config.nodes} x {config.stages} {config.model_loading_config.model_id}, "
          f"training share {config.train_rate:g}, {args.seconds:g} s of arrivals per run, {args.repeats} runs "
          f"per rate (seeds {args.seed}..{args.seed + args.repeats - 1}); {time.perf_counter() - started:.0f} s in all")
    print("| rate | policy | tasks/s median (min-max) | SLO att. median (min-max) | TTFT p50 ms median | "
          f"decision µs p50 median | {first} >= it (SLO, tput) |")
    print("|---:|---|---|---|---:|---:|---|")
    out, holds = [], True
    for rate in rates:
        base = runs[(rate, first)]
        for name in policies:
            rs = runs[(rate, name)]
            thr = [x["throughput"] for x in rs]
            slo = [x["slo_attainment"] for x in rs]
            ttft = statistics.median(x["ttft_p50_s"] for x in rs) * 1e3
            decide = statistics.median(x["decision_us_p50"] for x in rs)
            verdict = "-"
            if name != first:
                ok_s = holds_within_spread([x["slo_attainment"] for x in base], slo)
                ok_t = holds_within_spread([x["throughput"] for x in base], thr)
                holds &= ok_s and ok_t
                verdict = f"{'yes' if ok_s else 'no'}, {'yes' if ok_t else 'no'}"
            print(f"| {rate:g} | {name} | {statistics.median(thr):.2f} ({min(thr):.2f}-{max(thr):.2f}) | "
                  f"{statistics.median(slo):.2f} ({min(slo):.2f}-{max(slo):.2f}) | {ttft:.0f} | {decide:.0f} | {verdict} |")
            out.append({"rate": rate, "policy": name, "runs": rs})
    print(f"\n{first} holds at every rate: {'yes' if holds else 'no'}")
    if args.json:
        write_json(args.json, {"grid": out, "policies": policies, "rates": rates, "repeats": args.repeats})
    return 0


if __name__ == "__main__":
    sys.exit(main())
