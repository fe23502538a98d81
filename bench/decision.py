"""LeMix's cluster decision at scale: every node planned (exhaustive) against the node index.

Above ``LemixParams.scan_nodes`` placeable nodes, LeMix plans only the candidates the
node index finds (raycolo/online/scheduling/node_index.py) instead of every node. This measures,
in the discrete-event simulator (``raycolo.online.simulation.sim``, the code ``simulate-online``
runs), on the same task lists:

1. **Decision cost**: mean and p99 microseconds per decision (``OnlineScheduler``'s own
   timer around the policy), exhaustive and indexed, from 4 to 1,024 nodes of 2 stages,
   at ``--per-node-rps`` requests per second per node, training share ``--alpha``.
2. **Decision quality**: SLO attainment and throughput of both, and the share of the
   indexed run's decisions that pick the node the exhaustive scan picks on the same state
   (a shadow scan at every decision of the indexed run), over a grid of node counts, load
   levels, training shares and seeds. Medians over seeds; ratios indexed / exhaustive.
3. **Against the paper-literal planner** (``raycolo.online.lemix_params.PAPER_LITERAL``), 4 × 2,
   α 0.5, one cell below saturation and one past it: µs per decision, decisions per task
   (held training tasks are decided again on every event), µs per task, and what the
   decisions bought (SLO attainment). Medians of ``--repeats`` interleaved passes.

    .venv/bin/python bench/decision.py [--quick] [--tasks 4000] [--seeds 3] [--only paper]
        [--json out/bench_decision.json]
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common import write_json  # noqa: E402
from raycolo.online.scheduling.allocation import best_node  # noqa: E402
from raycolo.online.lemix_params import PAPER_LITERAL, LemixParams  # noqa: E402
from raycolo.online.scheduling.planning import commit  # noqa: E402
from raycolo.online.profiles import preset  # noqa: E402
from raycolo.online.simulation.sim import ClusterSimulator  # noqa: E402
from raycolo.online.tasks import poisson_workload  # noqa: E402
from raycolo.online.policies import make_online_policy  # noqa: E402

MODEL, STAGES = "llama-8b", 2
EXHAUSTIVE = 1 << 20      # scan_nodes above any node count: every node planned


class Shadowed:
    """Wraps a LeMix policy: at each decision, also scores every placeable node (pure, no
    commit) and counts whether the policy's choice is the exhaustive scan's node
    (``same``) or one with the same best score (``best``: nodes idle past the SLO tie,
    and the scan breaks ties by lowest index)."""

    def __init__(self, policy):
        self.policy, self.same, self.best, self.total = policy, 0, 0, 0

    def __getattr__(self, name):
        return getattr(self.policy, name)

    def allocate(self, task, sched, now):
        _, scores = self.policy.score(sched, task, now, sched.placeable)
        want = best_node(scores)
        got = self.policy.allocate(task, sched, now)
        if got is not None:
            self.total += 1
            self.same += got == want
            self.best += scores.get(got, float("-inf")) >= scores[want] - 1e-12 * abs(scores[want])
        return got


NEAR_TIE = 0.01      # the control's "as good": a score within 1% of the best


class NearTie:
    """The exhaustive scan, taking the lowest-index node whose score is within
    ``NEAR_TIE`` of the best rather than the best itself: the control that shows how far
    LeMix's results move when only choices its own scores call (nearly) as good change.
    (Its scores rest on predicted latencies whose error is far above 1%.)"""

    def __init__(self, policy):
        self.policy = policy

    def __getattr__(self, name):
        return getattr(self.policy, name)

    def allocate(self, task, sched, now):
        lemix = self.policy
        plans, scores = lemix.score(sched, task, now, sched.placeable)
        top = max(scores.values())
        n = min(m for m, v in scores.items() if v >= top - NEAR_TIE * abs(top))
        if task.is_train and lemix.capabilities.prioritize and lemix._at_risk(sched, n, plans[n], now):
            return None
        commit(sched.traces[n], plans[n].path, now)
        sched.pending_path = plans[n].path
        return n


def run(nodes, rate, alpha, tasks, seed, scan, shadow=False, control=False):
    params = LemixParams(scan_nodes=scan)
    policy = make_online_policy("lemix", params, nodes=nodes, train_rate=alpha)
    policy = NearTie(policy) if control else policy
    wrapped = Shadowed(policy) if shadow else policy
    sim = ClusterSimulator(poisson_workload(rate, alpha, tasks, seed=seed), preset(MODEL, STAGES), nodes, wrapped,
                           params)
    result = sim.run()
    result.decision_us_p99 = float(np.percentile(sim.cluster.scheduler.decision_us, 99))
    agree = (wrapped.same / wrapped.total, wrapped.best / wrapped.total) if shadow and wrapped.total else None
    return result, agree


def cost_table(args, report):
    print(f"## 1. Decision cost: {MODEL}, {STAGES} stages per node, {args.per_node_rps:g} rps per node, "
          f"alpha {args.alpha:g}, {args.tasks} tasks (microseconds per decision, this process's own timer)\n")
    print("| nodes | exhaustive mean | exhaustive p99 | indexed mean | indexed p99 | indexed / exhaustive |")
    print("|---:|---:|---:|---:|---:|---:|")
    rows = []
    for nodes in args.nodes:
        rate = args.per_node_rps * nodes
        cells = {}
        for mode, scan in (("exhaustive", EXHAUSTIVE), ("indexed", LemixParams().scan_nodes)):
            means, p99s = [], []
            for _ in range(args.repeats):
                result, _ = run(nodes, rate, args.alpha, args.tasks, 0, scan)
                means.append(result.decision_us_mean)
                p99s.append(result.decision_us_p99)
            cells[mode] = (statistics.median(means), statistics.median(p99s))
        (em, ep), (im, ip) = cells["exhaustive"], cells["indexed"]
        print(f"| {nodes} | {em:.1f} | {ep:.1f} | {im:.1f} | {ip:.1f} | {im / em:.2f} |")
        rows.append({"nodes": nodes, "exhaustive_us_mean": em, "exhaustive_us_p99": ep,
                     "indexed_us_mean": im, "indexed_us_p99": ip})
    report["cost"] = rows


def quality_table(args, report):
    print(f"\n## 2. Decision quality: exhaustive vs indexed on the same tasks ({args.tasks} tasks, "
          f"seeds 0..{args.seeds - 1}, medians)\n")
    print(f"'control': the scan taking the lowest-index node scoring within {NEAR_TIE:.0%} of the best "
          "(what LeMix's results do when only choices its own scores call as good change)\n")
    print("| nodes | rps/node | alpha | SLO exh. | SLO idx. | SLO control | thr. exh. | thr. idx. | thr. control "
          "| same node | best score |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    rows = []
    for nodes in args.quality_nodes:
        for per_node in args.loads:
            for alpha in args.alphas:
                slo_e, slo_i, slo_c, thr_e, thr_i, thr_c, same, best = [], [], [], [], [], [], [], []
                for seed in range(args.seeds):
                    e, _ = run(nodes, per_node * nodes, alpha, args.tasks, seed, EXHAUSTIVE)
                    i, agree = run(nodes, per_node * nodes, alpha, args.tasks, seed, LemixParams().scan_nodes,
                                   shadow=True)
                    c, _ = run(nodes, per_node * nodes, alpha, args.tasks, seed, EXHAUSTIVE, control=True)
                    slo_c.append(c.slo_attainment)
                    thr_c.append(c.throughput)
                    slo_e.append(e.slo_attainment)
                    slo_i.append(i.slo_attainment)
                    thr_e.append(e.throughput)
                    thr_i.append(i.throughput)
                    same.append(agree[0])
                    best.append(agree[1])
                row = {"nodes": nodes, "rps_per_node": per_node, "alpha": alpha,
                       "slo_exhaustive": statistics.median(slo_e), "slo_indexed": statistics.median(slo_i),
                       "slo_control": statistics.median(slo_c), "throughput_control": statistics.median(thr_c),
                       "throughput_exhaustive": statistics.median(thr_e),
                       "throughput_indexed": statistics.median(thr_i), "same_node": statistics.median(same),
                       "best_score": statistics.median(best)}
                rows.append(row)
                print(f"| {nodes} | {per_node:g} | {alpha:g} | {row['slo_exhaustive']:.3f} | "
                      f"{row['slo_indexed']:.3f} | {row['slo_control']:.3f} | {row['throughput_exhaustive']:.1f} | "
                      f"{row['throughput_indexed']:.1f} | {row['throughput_control']:.1f} | "
                      f"{row['same_node']:.1%} | {row['best_score']:.1%} |")
    for name in ("indexed", "control"):
        d_slo = [r[f"slo_{name}"] - r["slo_exhaustive"] for r in rows]
        d_thr = [r[f"throughput_{name}"] / r["throughput_exhaustive"] for r in rows]
        print(f"{name} vs exhaustive: SLO attainment difference median {np.median(d_slo):+.4f}, "
              f"mean |diff| {np.mean(np.abs(d_slo)):.4f}, range [{min(d_slo):+.4f}, {max(d_slo):+.4f}]; "
              f"throughput ratio median {np.median(d_thr):.4f}, range [{min(d_thr):.4f}, {max(d_thr):.4f}]")
    report["quality"] = rows


PAPER_CELLS = (("llama-8b", 50.0), ("gpt-2.5b", 150.0))   # (model, rps) at 4 × 2: below and past saturation


def paper_table(args, report):
    tasks = min(args.tasks, 2000)
    print(f"\n## 3. Against the paper-literal planner: 4 x {STAGES}, alpha 0.5, {tasks} tasks, seed 0, "
          f"medians of {args.repeats} interleaved passes\n")
    print("| cell | planner | us/decision | decisions/task | us/task | SLO attainment |")
    print("|---|---|---:|---:|---:|---:|")
    rows = []
    for model, rate in PAPER_CELLS:
        work = poisson_workload(rate, 0.5, tasks, seed=0)
        runs = {"default": [], "paper-literal": []}
        for _ in range(args.repeats):
            for name, overrides in (("default", {}), ("paper-literal", PAPER_LITERAL)):
                params = LemixParams(**overrides)
                sim = ClusterSimulator(work, preset(model, STAGES), 4,
                                       make_online_policy("lemix", params, nodes=4, train_rate=0.5), params)
                result = sim.run()
                decisions = sim.cluster.scheduler.decisions
                runs[name].append((result.decision_us_mean, decisions / tasks,
                                   sim.cluster.scheduler.decision_us_total / tasks, result.slo_attainment))
        cell = {}
        for name, values in runs.items():
            us, per_task, us_task, slo = (statistics.median(v[k] for v in values) for k in range(4))
            cell[name] = us_task
            rows.append({"model": model, "rps": rate, "planner": name, "us_per_decision": us,
                         "decisions_per_task": per_task, "us_per_task": us_task, "slo_attainment": slo})
            print(f"| {model}, {rate:g} rps | {name} | {us:.1f} | {per_task:.2f} | {us_task:.1f} | {slo:.3f} |")
        print(f"| {model}, {rate:g} rps | default / paper-literal per task | | | "
              f"{cell['default'] / cell['paper-literal']:.2f} | |")
    report["paper_literal"] = rows


def floats(text):
    return [float(x) for x in text.split(",")]


def ints(text):
    return [int(x) for x in text.split(",")]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer tasks, nodes and seeds (seconds)")
    ap.add_argument("--tasks", type=int, default=4000)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3, help="passes per cost cell (median)")
    ap.add_argument("--nodes", type=ints, default=[4, 16, 64, 256, 1024])
    ap.add_argument("--quality-nodes", type=ints, default=[32, 128, 512])
    ap.add_argument("--loads", type=floats, default=[6.0, 12.5], help="rps per node")
    ap.add_argument("--alphas", type=floats, default=[0.1, 0.5])
    ap.add_argument("--per-node-rps", type=float, default=12.5)
    ap.add_argument("--alpha", type=float, default=0.5)
    ap.add_argument("--only", choices=("cost", "quality", "paper"), default=None, help="one section")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.quick:
        args.tasks, args.seeds, args.repeats = 1000, 1, 1
        args.nodes, args.quality_nodes, args.loads, args.alphas = [4, 64, 1024], [64], [12.5], [0.5]
    report = {"model": MODEL, "stages": STAGES, "tasks": args.tasks}
    for name, section in (("cost", cost_table), ("quality", quality_table), ("paper", paper_table)):
        if args.only in (None, name):
            section(args, report)
    if args.json:
        write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
