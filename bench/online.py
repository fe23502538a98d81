"""Online benchmark: LeMix against its baselines on co-located serving and training.

Three parts, all in the discrete-event simulator of raycolo.online.simulation.sim (no GPUs):

1. The paper's setting (LeMix §VI-A/B, Fig. 11/12): 4 nodes x 2 stages, each model,
   each request rate x training rate (alpha); lemix, mix-rr, mix-luf and separate run
   on the SAME task list (same seed) per cell. One table per model with throughput
   (completed tasks / makespan) and SLO attainment (share of inference TTFTs within
   5x the Table II forward latency) per policy, and lemix/separate ratios; then the
   largest ratios next to the paper's (up to 3.53x throughput, 2.12x SLO attainment).
   Nothing here is tuned to match the paper: LemixParams() defaults throughout.
2. Ablations (§VI-F, Fig. 17): llama-70b at 50 and 150 rps, alpha 0.5, lemix and its
   three variants without profile / prioritization / memory awareness.
3. Decision overhead (§VI-F, Table III): microseconds per task of execution planning +
   allocation (OnlineScheduler.submit) for lemix and mix-rr, llama-8b, 4..256 nodes at
   12.5 rps per node, alpha 0.5. Execution is NOT simulated there: tasks go through
   submit in arrival order with now = arrival, and each planned forward/backward is
   reported back (OnlineScheduler.observe) as executed exactly as planned once the
   clock passes its planned end, so finished training tasks leave the trace queues.

Metrics are medians over --seeds seeds (0, 1, ...); ratios are ratios of those medians.
Overhead figures are medians over --repeats passes of each pass's mean and p99.
The default run (1000 tasks, 1 seed, 3 models x 4 rates x 3 alphas x 4 policies) takes
about 1 minute on a (shared, noisy) 2-core machine; --quick takes a few seconds.

    .venv/bin/python bench/online.py [--quick] [--tasks 1000] [--seeds 1] [--plots]
        [--models llama-8b,llama-13b,llama-70b] [--rates 10,50,100,150]
        [--train-rates 0.1,0.5,0.9] [--json out/bench_online.json]
"""
from __future__ import annotations

import argparse
import heapq
import json
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from raycolo.online.lemix_params import LemixParams  # noqa: E402
from raycolo.online.profiles import preset  # noqa: E402
from raycolo.online.scheduling.scheduler import OnlineScheduler  # noqa: E402
from raycolo.online.simulation.sim import simulate  # noqa: E402
from raycolo.online.tasks import poisson_workload  # noqa: E402
from raycolo.online.policies import make_online_policy  # noqa: E402

NODES, STAGES = 4, 2
POLICIES = ["lemix", "mix-rr", "mix-luf", "separate"]
ABLATIONS = ["lemix", "lemix-noprofile", "lemix-noprioritize", "lemix-nomemory"]
ABLATION_MODEL, ABLATION_RATES, ABLATION_ALPHA = "llama-70b", (50, 150), 0.5
OVERHEAD_MODEL, OVERHEAD_PER_NODE_RPS, OVERHEAD_ALPHA = "llama-8b", 12.5, 0.5
PAPER_THROUGHPUT_RATIO, PAPER_SLO_RATIO = 3.53, 2.12
PAPER_EP_MS, PAPER_RA_MS, PAPER_RR_MS, TARGET_MS = 0.14, 0.014, 0.015, 0.1


def csv_list(kind):
    return lambda text: [kind(x) for x in text.split(",") if x.strip()]


def run_cell(model, rate, alpha, tasks, seeds, policies):
    """Median over seeds of each policy's summary on one (model, rate, alpha) cell."""
    profile = preset(model, stages=STAGES)
    per_policy = {p: [] for p in policies}
    for seed in range(seeds):
        workload = poisson_workload(rate, alpha, tasks, seed=seed)
        for name in policies:  # the same task list for every policy
            params = LemixParams()
            policy = make_online_policy(name, params, nodes=NODES, train_rate=alpha)
            result = simulate(workload, profile, NODES, policy, params)
            if result.completed != len(workload):
                raise SystemExit(f"{model} {rate} rps a={alpha} {name} seed {seed}: "
                                 f"{result.completed} of {len(workload)} tasks completed")
            per_policy[name].append(result.summary())
    out = {}
    for name, summaries in per_policy.items():
        keys = [k for k, v in summaries[0].items() if isinstance(v, (int, float)) and v is not None]
        out[name] = {k: statistics.median(s[k] for s in summaries) for k in keys}
    return out


def ratio(a, b):
    if b > 0:
        return a / b
    return math.inf if a > 0 else 1.0


def fmt_ratio(r):
    return "inf" if math.isinf(r) else f"{r:.2f}x"


def main_grid(args, report):
    print(f"\n## 1. Paper setting: {NODES} nodes x {STAGES} stages, hh-rlhf lengths, {args.tasks} tasks, "
          f"{args.seeds} seed(s); throughput in tasks/s, SLO = share of TTFT <= 5x forward latency")
    summary_lines = []
    for model in args.models:
        cells = {}
        head = ("| rate | a | " + " | ".join(f"thr {p}" for p in POLICIES) + " | "
                + " | ".join(f"SLO {p}" for p in POLICIES) + " | thr lemix/sep | SLO lemix/sep | lemix nodes |")
        print(f"\n### {model}  (SLO {LemixParams().slo_s(preset(model, STAGES).forward_latency_s) * 1e3:.0f} ms)")
        print(head)
        print("|" + "---:|" * (head.count("|") - 1))
        for rate in args.rates:
            for alpha in args.train_rates:
                rows = run_cell(model, rate, alpha, args.tasks, args.seeds, POLICIES)
                lem, sep = rows["lemix"], rows["separate"]
                thr_r = ratio(lem["throughput"], sep["throughput"])
                slo_r = ratio(lem["slo_attainment"], sep["slo_attainment"])
                cells[(rate, alpha)] = {"rows": rows, "thr_ratio": thr_r, "slo_ratio": slo_r}
                print(f"| {rate:g} | {alpha:g} | "
                      + " | ".join(f"{rows[p]['throughput']:.2f}" for p in POLICIES) + " | "
                      + " | ".join(f"{rows[p]['slo_attainment']:.3f}" for p in POLICIES)
                      + f" | {fmt_ratio(thr_r)} | {fmt_ratio(slo_r)} | {lem['active_nodes_mean']:.2f} |")
                sys.stdout.flush()
        report["grid"][model] = {f"{r}/{a}": c for (r, a), c in cells.items()}
        thr_cell = max(cells, key=lambda k: cells[k]["thr_ratio"])
        finite = {k: c for k, c in cells.items() if not math.isinf(c["slo_ratio"])}
        slo_cell = max(finite, key=lambda k: finite[k]["slo_ratio"]) if finite else None
        zero_sep = len(cells) - len(finite)
        line = (f"{model}: max throughput lemix/separate {fmt_ratio(cells[thr_cell]['thr_ratio'])} "
                f"(at {thr_cell[0]:g} rps, a={thr_cell[1]:g}; paper up to {PAPER_THROUGHPUT_RATIO}x), "
                f"max SLO lemix/separate "
                + (f"{fmt_ratio(finite[slo_cell]['slo_ratio'])} (at {slo_cell[0]:g} rps, a={slo_cell[1]:g}"
                   if slo_cell else "n/a (")
                + f"; paper up to {PAPER_SLO_RATIO}x)"
                + (f", plus {zero_sep} cell(s) where separate met no SLO and lemix some" if zero_sep else ""))
        summary_lines.append(line)
    print("\n### Largest lemix/separate ratios over the cells above")
    for line in summary_lines:
        print(line)


def main_ablation(args, report):
    print(f"\n## 2. Ablations: {ABLATION_MODEL}, {NODES}x{STAGES}, a={ABLATION_ALPHA}, {args.tasks} tasks, "
          f"{args.seeds} seed(s)")
    print("| rate | policy | throughput | SLO | TTFT p50 s | TTFT p99 s | offloads | overruns "
          "| memory waits | deferred max |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for rate in ABLATION_RATES:
        rows = run_cell(ABLATION_MODEL, rate, ABLATION_ALPHA, args.tasks, args.seeds, ABLATIONS)
        report["ablation"][str(rate)] = rows
        for name in ABLATIONS:
            r = rows[name]
            print(f"| {rate} | {name} | {r['throughput']:.2f} | {r['slo_attainment']:.3f} "
                  f"| {r['ttft_p50_s']:.2f} | {r['ttft_p99_s']:.2f} | {r['offloads']:.0f} "
                  f"| {r['overruns']:.0f} | {r['memory_waits']:.0f} | {r['deferred_max']:.0f} |")
        sys.stdout.flush()


def decision_pass(policy_name, nodes, tasks, feedback=True):
    """Per-task µs of OnlineScheduler.submit (planning + allocation) in arrival order.

    With ``feedback``, every planned operation is reported as executed as planned once
    the next arrival's clock passes its planned end (no execution is simulated)."""
    profile = preset(OVERHEAD_MODEL, stages=STAGES)
    params = LemixParams()
    policy = make_online_policy(policy_name, params, nodes=nodes, train_rate=OVERHEAD_ALPHA)
    sched = OnlineScheduler(policy, [profile] * nodes, [profile] * nodes, params)
    events, spent, deferred = [], [], 0

    def planned(decision):
        path = decision.path
        if not feedback or path is None:
            return
        for s, st in enumerate(path.stages):
            heapq.heappush(events, (st.end_f, path.task_id, s, "forward", st.start_f))
            if st.end_b is not None:
                heapq.heappush(events, (st.end_b, path.task_id, s, "backward", st.start_b))

    for i, task in enumerate(tasks):
        now = task.arrival_s
        sched.arrivals_done = i == len(tasks) - 1
        while events and events[0][0] <= now:
            end, task_id, stage, kind, start = heapq.heappop(events)
            sched.observe(task_id, stage, kind, start, end)
        before = sched.decision_us_total
        decision = sched.submit(task, now)
        spent.append(sched.decision_us_total - before)  # also counts a deferral
        if decision is None:
            deferred += 1
        else:
            planned(decision)
        for retried in sched.retry(now):
            planned(retried)
    spent = np.array(spent)
    return float(spent.mean()), float(np.percentile(spent, 99)), deferred


def main_overhead(args, report):
    tasks_n = args.overhead_tasks
    print(f"\n## 3. Decision overhead: {OVERHEAD_MODEL}, {STAGES} stages per node, "
          f"{OVERHEAD_PER_NODE_RPS:g} rps per node, a={OVERHEAD_ALPHA}, {tasks_n} tasks, "
          f"median of {args.repeats} pass(es)")
    print("Execution is not simulated here: tasks go through OnlineScheduler.submit in arrival "
          "order (now = arrival), and planned operations are reported as executed as planned once "
          "the clock passes their end. us = planning + allocation of one task (deferrals included).")
    print("| nodes | rps | lemix mean us | lemix p99 us | mix-rr mean us | mix-rr p99 us | lemix deferred |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for nodes in args.overhead_nodes:
        rate = OVERHEAD_PER_NODE_RPS * nodes
        tasks = poisson_workload(rate, OVERHEAD_ALPHA, tasks_n, seed=0)
        row = {}
        for name in ("lemix", "mix-rr"):
            passes = [decision_pass(name, nodes, tasks) for _ in range(args.repeats)]
            row[name] = {"mean_us": statistics.median(p[0] for p in passes),
                         "p99_us": statistics.median(p[1] for p in passes),
                         "deferred": passes[0][2]}
        report["overhead"][str(nodes)] = row
        print(f"| {nodes} | {rate:g} | {row['lemix']['mean_us']:.1f} | {row['lemix']['p99_us']:.1f} "
              f"| {row['mix-rr']['mean_us']:.1f} | {row['mix-rr']['p99_us']:.1f} "
              f"| {row['lemix']['deferred']} |")
        sys.stdout.flush()
    first = report["overhead"].get(str(NODES))
    if first:
        mean_ms = first["lemix"]["mean_us"] / 1e3
        verdict = "meets" if mean_ms <= TARGET_MS else "MISSES"
        print(f"At {NODES}x{STAGES}: lemix {mean_ms:.3f} ms per task; paper EP {PAPER_EP_MS} ms "
              f"(+ RA {PAPER_RA_MS} ms), RR {PAPER_RR_MS} ms; target <= {TARGET_MS} ms: {verdict}")
    nofb = decision_pass("lemix", NODES, poisson_workload(OVERHEAD_PER_NODE_RPS * NODES, OVERHEAD_ALPHA,
                                                          tasks_n, seed=0), feedback=False)
    print(f"Reference, {NODES} nodes without observe() feedback (planned paths never calibrated): "
          f"lemix mean {nofb[0]:.1f} us, p99 {nofb[1]:.1f} us")
    cell = report["grid"].get(OVERHEAD_MODEL, {}).get(f"{OVERHEAD_PER_NODE_RPS * NODES:g}/{OVERHEAD_ALPHA:g}")
    if cell:
        print(f"Reference, inside the simulator ({NODES}x{STAGES}, {OVERHEAD_PER_NODE_RPS * NODES:g} rps, "
              f"a={OVERHEAD_ALPHA}, retries included): lemix {cell['rows']['lemix']['decision_us_mean']:.1f} us, "
              f"mix-rr {cell['rows']['mix-rr']['decision_us_mean']:.1f} us per decision")


def write_plots(args, report):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = ROOT / "out"
    out.mkdir(exist_ok=True)
    for metric, label, filename in (("throughput", "throughput (tasks/s)", "online_throughput.png"),
                                    ("slo_attainment", "SLO attainment", "online_slo.png")):
        fig, axes = plt.subplots(len(args.train_rates), len(args.models), squeeze=False,
                                 figsize=(4 * len(args.models), 3 * len(args.train_rates)))
        for j, model in enumerate(args.models):
            for i, alpha in enumerate(args.train_rates):
                ax = axes[i][j]
                for name in POLICIES:
                    ys = [report["grid"][model][f"{r}/{alpha}"]["rows"][name][metric] for r in args.rates]
                    ax.plot(args.rates, ys, marker="o", label=name)
                ax.set_title(f"{model}, a={alpha:g}", fontsize=9)
                ax.set_xlabel("request rate (rps)")
                ax.set_ylabel(label)
                ax.grid(alpha=0.3)
        axes[0][0].legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / filename, dpi=120)
        plt.close(fig)
        print(f"wrote {out / filename}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", type=int, default=1000, help="tasks per workload (paper: 1000)")
    ap.add_argument("--seeds", type=int, default=1, help="workload seeds; metrics are medians")
    ap.add_argument("--models", type=csv_list(str), default=["llama-8b", "llama-13b", "llama-70b"])
    ap.add_argument("--rates", type=csv_list(float), default=[10, 50, 100, 150], help="request rates (rps)")
    ap.add_argument("--train-rates", type=csv_list(float), default=[0.1, 0.5, 0.9], help="training rates a")
    ap.add_argument("--overhead-nodes", type=csv_list(int), default=[4, 16, 64, 256])
    ap.add_argument("--overhead-tasks", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=3, help="decision-overhead passes (median)")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: 300 tasks, llama-8b and llama-70b, 10 and 150 rps, a=0.5, "
                         "overhead at 4 and 16 nodes with 500 tasks, 1 pass")
    ap.add_argument("--skip-grid", action="store_true")
    ap.add_argument("--skip-ablation", action="store_true")
    ap.add_argument("--skip-overhead", action="store_true")
    ap.add_argument("--plots", action="store_true", help="write out/online_throughput.png and out/online_slo.png")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()
    if args.quick:
        args.tasks, args.models, args.rates, args.train_rates = 300, ["llama-8b", "llama-70b"], [10, 150], [0.5]
        args.overhead_nodes, args.overhead_tasks, args.repeats = [4, 16], 500, 1
    args.rates = [int(r) if float(r).is_integer() else r for r in args.rates]
    if args.tasks < 1 or args.seeds < 1 or args.repeats < 1:
        ap.error("--tasks, --seeds and --repeats must be positive")

    started = time.perf_counter()
    report = {"grid": {}, "ablation": {}, "overhead": {}}
    print(f"Online benchmark (LeMix): simulator, LemixParams() defaults, policies {', '.join(POLICIES)}")
    if not args.skip_grid:
        main_grid(args, report)
    if not args.skip_ablation:
        main_ablation(args, report)
    if not args.skip_overhead:
        main_overhead(args, report)
    if args.plots and report["grid"]:
        write_plots(args, report)
    print(f"\nbenchmark wall time {time.perf_counter() - started:.0f}s")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
